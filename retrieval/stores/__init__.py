"""Vector stores behind one interface: Qdrant server and Qdrant Edge."""
