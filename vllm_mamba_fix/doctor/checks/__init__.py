"""The checks; each fills in its part of the report's JSON body. A check may import doctor's
report and verdict and every layer below; none imports ``install/plugin.py`` (core hands it
over)."""
