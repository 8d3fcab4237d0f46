"""The bottom layer: the array boundary (``arrays``, ``streams``), the supported types and the
argument checks every call shares (``types``), the checked calls (``problems``), the device
error word (``errors``), and the compiler (``compiler``; offline NVRTC in ``nvrtc``).  It
imports nothing else of the package."""
