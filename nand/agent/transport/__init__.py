"""Delivery to the server over ZeroMQ from a background thread: never blocks
training. ``server_sink`` hands messages to the ``mailbox``; the ``sender``
thread sends them over a ``connection``, keeps what is unacknowledged
(``backlog``) and spools it to disk while the server is away (``spool``);
``replay`` and ``commands`` send a spool later (``nand spool``)."""
