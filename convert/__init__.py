"""Checkpoint conversion: public draft formats <-> draftsmith's native heads (`draftsmith convert`)."""
