"""One check per module; each fills in its part of the doctor's ``Report``."""
