"""All-reduce on the daemons: operations, chunks, tree and ring routes."""
