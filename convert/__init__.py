"""`draftsmith convert`: public draft formats <-> draftsmith's native heads. The formats themselves come
from the methods (each method's `convert.py`, registered with `draftsmith.methods.formats`)."""
