"""ray.util of the stand-in."""


def __getattr__(name):
    import ray

    return ray._Anything
