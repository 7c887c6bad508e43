//! Host networking for k7d: taps, bridges, veths (filled in by the datapath issue).
