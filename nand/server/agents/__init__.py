"""The agents' side: receive, admit, store what agents send, and send them orders."""
