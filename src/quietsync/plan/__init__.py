"""quietsync plan (work in progress)."""
