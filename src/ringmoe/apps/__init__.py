"""The commands' jobs, named after them: ``check`` (and ``attention``), ``demo`` and its model recipe."""
