"""Versioned SQL migrations, applied in order by gateway.database."""
