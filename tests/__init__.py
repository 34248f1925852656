"""The astrai test suite (a package, so table rows can bind ``tests._impls:...``)."""
