"""Storage: the tables, their migrations and the queries the REST API makes."""
