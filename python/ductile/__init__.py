"""ductile: the Python side of ductile-agent's control channel.

ductile.control speaks the agent's control protocol (standard library
only); ductile.torch rebuilds a PyTorch DDP script in place when the job's
membership changes (it imports torch).
"""
__version__ = "0.1.0"
