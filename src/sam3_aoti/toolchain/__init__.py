"""The CUDA toolkit and C++ compiler AOTInductor builds with: the pinned pip wheels or the machine's, the
known compiler fixes, the probe, and `cuda.env`."""
