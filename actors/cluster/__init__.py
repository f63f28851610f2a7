"""Several nodes on one log: sessions hash to partitions, a node owns partitions through leases
in a JetStream key-value bucket, and every command for a session goes to its partition's owner
(docs/architecture.md, "Ownership")."""
