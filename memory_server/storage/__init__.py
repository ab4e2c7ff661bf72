"""Storage: the SQL engine and the vector indexes derived from it."""
