"""The server role: hand-off to the server process, the verdict store, aggregates and synchronous rounds."""
