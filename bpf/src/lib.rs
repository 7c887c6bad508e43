//! tc-eBPF programs (C, built with clang) and their aya loader (filled in by the datapath issue).
