"""The worker role: intake of pushes and gets, the pushes it holds until they resolve, the fallback."""
