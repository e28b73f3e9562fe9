"""The `pdserve` command: one entry point for whichever parts of pdserve are installed
(`pdserve-workers`, `pdserve-operator`)."""
