"""`draftsmith check`: the acceptance gate. A head is run against its target on prompts the target writes
itself, its acceptance per draft position is compared with the head's own record (or a floor), and where it
fails, the doctor re-reads the checkpoint under the conventions a converter can slip on and names the one
that accepts."""
