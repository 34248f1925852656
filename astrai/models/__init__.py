"""Small models built only from the astrai facades (for the demo and the tests)."""
