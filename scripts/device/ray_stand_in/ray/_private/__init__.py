"""ray._private of the stand-in."""
