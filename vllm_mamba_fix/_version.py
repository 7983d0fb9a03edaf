"""The package's version: its one source (pyproject.toml reads it), imported by no other module
of the plugin's but as a value, so that nothing the plugin runs imports the package itself."""

__version__ = "0.6.5"
