//! Architecture support: x86_64 Linux boot (filled in by the Linux-boot work).
