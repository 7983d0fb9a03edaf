"""The checks; each fills in its part of the report's JSON body. None imports
``install/plugin.py``: core hands it over."""
