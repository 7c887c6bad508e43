//! Assembles the test guests at build time (see `src/programs.rs`).

#[path = "src/defs.rs"]
mod defs;
#[path = "src/programs.rs"]
mod programs;

fn main() {
    println!("cargo:rerun-if-changed=src/programs.rs");
    println!("cargo:rerun-if-changed=src/defs.rs");
    let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    for name in defs::BUILTIN_NAMES {
        let b = defs::Builtin::from_name(name).expect("known name");
        let img = programs::build(b).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            defs::LOAD_ADDR as usize + img.len() < 0x10000,
            "guest {name} does not fit below 64 KiB"
        );
        std::fs::write(out.join(format!("{name}.bin")), img).expect("write guest image");
    }
    let bios = programs::hello_bios_image().unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(out.join("hello-bios.bin"), bios).expect("write bios image");
}
