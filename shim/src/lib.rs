//! containerd shim v2 for k7d (filled in by the Secure Containers issue).
