"""What telling a model's modules apart rests on, below every family and every
integration: reading a module or function as it is, through whatever wraps it
(``inspection``), and a copy of a function that sees some of its globals as other objects
(``rebind``). It imports torch and nothing of astrai's."""
