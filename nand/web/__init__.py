"""The dashboard: static HTML/JS/CSS served by the server at ``/``."""
