//! Small purpose-built guests for k7d's host-level tests.
//!
//! The host KVM on the development machines is PVM: stock Linux does not boot
//! there, real-mode code does (see `docs/testing.md`). These guests are 16-bit
//! real-mode programs assembled here, in Rust, with iced-x86's `code_asm`, so
//! building k7d needs no external assembler. Each program is loaded at
//! [`LOAD_ADDR`] and entered with `cs = 0, ip = LOAD_ADDR`.
//!
//! Guest memory layout shared by the VMM, the programs and the tests:
//!
//! | address | what |
//! |---|---|
//! | `0x0000..0x0400` | real-mode IVT (the guests install their handlers) |
//! | [`PARAMS_ADDR`] | parameters written by the VMM before the first instruction |
//! | [`RESULTS_ADDR`] | counters and flags written by the guest, read by tests |
//! | `0x6000`, `0x7000` | AP and BSP stack tops |
//! | [`LOAD_ADDR`] | program entry (BSP) |
//! | [`AP_ENTRY_ADDR`] | application-processor entry (SIPI vector `0x09`) |

//!
//! The programs are assembled at build time (`build.rs` runs
//! `src/programs.rs`, written with iced-x86's `code_asm`) and embedded here,
//! so starting a VM costs no assembly and the binary carries no assembler.

mod defs;

pub use defs::*;

macro_rules! image {
    ($name:literal) => {
        include_bytes!(concat!(env!("OUT_DIR"), "/", $name, ".bin"))
    };
}

impl Builtin {
    /// The program's bytes, to load at [`LOAD_ADDR`] (for `smp` the image is
    /// longer than `AP_ENTRY_ADDR - LOAD_ADDR` and carries the AP code at that
    /// offset).
    pub fn image(self) -> &'static [u8] {
        match self {
            Self::Hello => image!("hello"),
            Self::Idle => image!("idle"),
            Self::Pit => image!("pit"),
            Self::TscDeadline => image!("tscdeadline"),
            Self::MemWriter => image!("memwriter"),
            Self::Smp => image!("smp"),
            Self::Fault => image!("fault"),
            Self::Drill => image!("drill"),
            Self::Uart => image!("uart"),
        }
    }
}

/// The `hello` program packaged as a 64 KiB `-bios` image for QEMU: the code
/// at `0xf000:0000`, a far jump to it at the reset vector (`0xf000:fff0`).
pub fn hello_bios_image() -> &'static [u8] {
    image!("hello-bios")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_is_embedded_and_fits() {
        for name in BUILTIN_NAMES {
            let b = Builtin::from_name(name).unwrap();
            assert_eq!(b.name(), name);
            let img = b.image();
            assert!(!img.is_empty(), "{name} is empty");
            assert!((LOAD_ADDR as usize + img.len()) < 0x10000, "{name} too large");
        }
    }

    #[test]
    fn bios_image_has_reset_jump() {
        let img = hello_bios_image();
        assert_eq!(img.len(), BIOS_IMAGE_SIZE);
        assert_eq!(&img[0xfff0..0xfff5], &[0xea, 0x00, 0x00, 0x00, 0xf0]);
    }

    #[test]
    fn unknown_name_is_refused() {
        let e = Builtin::from_name("nope").unwrap_err().to_string();
        assert!(e.contains("unknown built-in guest `nope`"), "{e}");
    }
}
