"""yeto_sync: the YETO v4 syncer (coordinator, merge math, transports, ``yeto-sync`` daemon)."""
