//! The programs themselves, written with iced-x86's `code_asm`. Compiled into
//! `build.rs` (not the library): the build writes each image to `OUT_DIR`.
//!
//! Conventions: `cs = ds = es = ss = 0` (the VMM gives DS/ES/SS 4 GiB limits,
//! "big real mode", so 32-bit addresses reach memory above 1 MiB); strings are
//! printed inline (`mov al, c; out dx, al`) so no program needs the address of
//! its own data.

use iced_x86::IcedError;
use iced_x86::code_asm::*;

use crate::defs::{
    AP_ENTRY_ADDR, BIOS_IMAGE_SIZE, Builtin, GuestError, HELLO_TEXT, LOAD_ADDR, PARAMS_ADDR, RESULTS_ADDR, param,
    result,
};

const COM1: u32 = 0x3f8;
const BSP_STACK: u32 = 0x7000;
const AP_STACK: u32 = 0x6000;
const PIT_VECTOR: u64 = 0x20;
/// `uart`'s vector for COM1 (IOAPIC pin 4).
const COM1_VECTOR: u64 = 0x24;
const IOAPIC_BASE: u32 = 0xfec0_0000;
const TIMER_VECTOR: u64 = 0x30;
/// 1193182 Hz / 1193 = 1000.15 Hz.
const PIT_DIVISOR_1KHZ: u32 = 1193;
const MSR_APIC_BASE: u32 = 0x1b;
const MSR_X2APIC_EOI: u32 = 0x80b;
const MSR_X2APIC_SVR: u32 = 0x80f;
const MSR_X2APIC_ICR: u32 = 0x830;
const MSR_X2APIC_LVT_TIMER: u32 = 0x832;
const MSR_TSC_DEADLINE: u32 = 0x6e0;

fn params(off: u64) -> u64 {
    PARAMS_ADDR + off
}

fn results(off: u64) -> u64 {
    RESULTS_ADDR + off
}

pub fn build(which: Builtin) -> Result<Vec<u8>, GuestError> {
    let name = which.name();
    let wrap = |e: IcedError| GuestError::Assemble {
        name,
        msg: e.to_string(),
    };
    match which {
        Builtin::Hello => hello(LOAD_ADDR).map_err(wrap),
        Builtin::Idle => idle().map_err(wrap),
        Builtin::Pit => pit().map_err(wrap),
        Builtin::TscDeadline => tscdeadline().map_err(wrap),
        Builtin::MemWriter => memwriter().map_err(wrap),
        Builtin::Smp => smp().map_err(wrap),
        Builtin::Fault => fault().map_err(wrap),
        Builtin::Drill => drill().map_err(wrap),
        Builtin::Uart => uart().map_err(wrap),
    }
}

/// Sets up a stack. The BSP keeps the segment registers the VMM gave it
/// (base 0, 4 GiB limits): a real-mode segment load would reset the limit to
/// 64 KiB (KVM's emulator does, as hardware does) and end "big real mode".
fn prologue(a: &mut CodeAssembler, stack: u32) -> Result<(), IcedError> {
    a.cli()?;
    a.mov(sp, stack)?;
    a.cld()
}

/// The AP starts from SIPI with `cs = vector << 8` and other segments at 0
/// with 64 KiB limits: zero them explicitly and set up its stack.
fn ap_prologue(a: &mut CodeAssembler, stack: u32) -> Result<(), IcedError> {
    a.cli()?;
    a.xor(ax, ax)?;
    a.mov(ds, ax)?;
    a.mov(es, ax)?;
    a.mov(ss, ax)?;
    a.mov(sp, stack)?;
    a.cld()
}

fn print(a: &mut CodeAssembler, text: &str) -> Result<(), IcedError> {
    a.mov(dx, COM1)?;
    for b in text.bytes() {
        a.mov(al, b as u32)?;
        a.out(dx, al)?;
    }
    Ok(())
}

/// Resets the machine through the i8042 controller (the VMM stops the VM).
fn reset(a: &mut CodeAssembler) -> Result<(), IcedError> {
    a.mov(al, 0xfe_u32)?;
    a.out(0x64_u32, al)?;
    halt_forever(a)
}

fn halt_forever(a: &mut CodeAssembler) -> Result<(), IcedError> {
    let mut l = a.create_label();
    a.set_label(&mut l)?;
    a.cli()?;
    a.hlt()?;
    a.jmp(l)
}

/// `sti; hlt` forever: the interrupt handlers do the work.
fn idle_with_interrupts(a: &mut CodeAssembler) -> Result<(), IcedError> {
    let mut l = a.create_label();
    a.sti()?;
    a.set_label(&mut l)?;
    a.hlt()?;
    a.jmp(l)
}

fn hello(origin: u64) -> Result<Vec<u8>, IcedError> {
    let mut a = CodeAssembler::new(16)?;
    print(&mut a, HELLO_TEXT)?;
    reset(&mut a)?;
    a.assemble(origin)
}

fn idle() -> Result<Vec<u8>, IcedError> {
    let mut a = CodeAssembler::new(16)?;
    prologue(&mut a, BSP_STACK)?;
    print(&mut a, "idle\n")?;
    halt_forever(&mut a)?;
    a.assemble(LOAD_ADDR)
}

/// The `hello` program packaged as a 64 KiB `-bios` image for QEMU: the code at
/// `0xf000:0000`, a far jump to it at the reset vector (`0xf000:fff0`).
pub fn hello_bios_image() -> Result<Vec<u8>, GuestError> {
    let code = hello(0).map_err(|e| GuestError::Assemble {
        name: "hello-bios",
        msg: e.to_string(),
    })?;
    let mut img = vec![0xf4_u8; BIOS_IMAGE_SIZE];
    img[..code.len()].copy_from_slice(&code);
    // jmp far 0xf000:0x0000
    img[0xfff0..0xfff5].copy_from_slice(&[0xea, 0x00, 0x00, 0x00, 0xf0]);
    Ok(img)
}

/// A program whose interrupt handlers are installed by absolute address: the
/// handlers are assembled first at a known address, then the main code.
struct Layout {
    handlers: Vec<u8>,
}

const HANDLER_BASE: u64 = LOAD_ADDR + 0x800;

/// Emits `mov word [vector*4], handler_addr; mov word [vector*4+2], 0`.
fn install(a: &mut CodeAssembler, vector: u64, handler_addr: u64) -> Result<(), IcedError> {
    a.mov(word_ptr(vector * 4), handler_addr as u32)?;
    a.mov(word_ptr(vector * 4 + 2), 0_u32)
}

/// Joins main code (at `LOAD_ADDR`) and handlers (at `HANDLER_BASE`).
fn join(main: Vec<u8>, layout: Layout) -> Vec<u8> {
    let off = (HANDLER_BASE - LOAD_ADDR) as usize;
    assert!(main.len() <= off, "guest main code overlaps its handlers");
    let mut img = main;
    img.resize(off, 0xf4);
    img.extend_from_slice(&layout.handlers);
    img
}

fn pit_handler() -> Result<Vec<u8>, IcedError> {
    let mut a = CodeAssembler::new(16)?;
    a.push(ax)?;
    a.inc(dword_ptr(results(result::BSP_TICKS)))?;
    a.mov(al, 0x20_u32)?;
    a.out(0x20_u32, al)?; // non-specific EOI to the master PIC
    a.pop(ax)?;
    a.iret()?;
    a.assemble(HANDLER_BASE)
}

/// Master PIC: ICW1 (edge, ICW4), ICW2 vector base 0x20, ICW3 slave on
/// IR2, ICW4 8086 (every IRQ unmasked until the caller masks); slave PIC:
/// vector base 0x28, cascade identity 2, 8086, all masked.
fn init_pics(a: &mut CodeAssembler) -> Result<(), IcedError> {
    for (port, v) in [(0x20, 0x11), (0x21, 0x20), (0x21, 0x04), (0x21, 0x01)] {
        a.mov(al, v as u32)?;
        a.out(port as u32, al)?;
    }
    for (port, v) in [(0xa0, 0x11), (0xa1, 0x28), (0xa1, 0x02), (0xa1, 0x01), (0xa1, 0xff)] {
        a.mov(al, v as u32)?;
        a.out(port as u32, al)?;
    }
    Ok(())
}

fn pit() -> Result<Vec<u8>, IcedError> {
    let handlers = pit_handler()?;
    let mut a = CodeAssembler::new(16)?;
    prologue(&mut a, BSP_STACK)?;
    install(&mut a, PIT_VECTOR, HANDLER_BASE)?;
    init_pics(&mut a)?;
    // Unmask IRQ0 only.
    a.mov(al, 0xfe_u32)?;
    a.out(0x21_u32, al)?;
    // PIT channel 0, lobyte/hibyte, mode 2 (rate generator), 1 kHz.
    a.mov(al, 0x34_u32)?;
    a.out(0x43_u32, al)?;
    a.mov(al, PIT_DIVISOR_1KHZ & 0xff)?;
    a.out(0x40_u32, al)?;
    a.mov(al, PIT_DIVISOR_1KHZ >> 8)?;
    a.out(0x40_u32, al)?;
    print(&mut a, "pit: 1 kHz\n")?;
    idle_with_interrupts(&mut a)?;
    Ok(join(a.assemble(LOAD_ADDR)?, Layout { handlers }))
}

/// Handler: acknowledge COM1 (read IIR), count it, EOI through the x2APIC.
fn uart_handler() -> Result<Vec<u8>, IcedError> {
    let mut a = CodeAssembler::new(16)?;
    a.push(eax)?;
    a.push(ecx)?;
    a.push(edx)?;
    a.mov(dx, COM1 + 2)?;
    a.in_(al, dx)?;
    a.inc(dword_ptr(results(result::SERIAL_IRQS)))?;
    x2apic_eoi(&mut a)?;
    a.pop(edx)?;
    a.pop(ecx)?;
    a.pop(eax)?;
    a.iret()?;
    a.assemble(HANDLER_BASE)
}

/// COM1's interrupt the way a Linux guest takes it: IOAPIC pin 4 to the
/// BSP's x2APIC (the PICs masked), so a restore that loses the edge to a
/// LAPIC not yet restored shows.
fn uart() -> Result<Vec<u8>, IcedError> {
    let handlers = uart_handler()?;
    let mut a = CodeAssembler::new(16)?;
    prologue(&mut a, BSP_STACK)?;
    install(&mut a, COM1_VECTOR, HANDLER_BASE)?;
    // Both PICs masked: IRQ4 reaches the CPU through the IOAPIC alone.
    a.mov(al, 0xff_u32)?;
    a.out(0x21_u32, al)?;
    a.out(0xa1_u32, al)?;
    x2apic_enable(&mut a)?;
    // IOAPIC redirection entry 4: fixed, physical, edge, unmasked, to APIC 0.
    a.mov(ebx, IOAPIC_BASE)?;
    for (reg, v) in [(0x19_u32, 0_u32), (0x18, COM1_VECTOR as u32)] {
        a.mov(dword_ptr(ebx), reg)?;
        a.mov(dword_ptr(ebx + 0x10), v)?;
    }
    print(&mut a, "uart: thri on\n")?;
    // IER = THRI: the empty THR interrupts once, taken after `sti`.
    a.mov(dx, COM1 + 1)?;
    a.mov(al, 0x02_u32)?;
    a.out(dx, al)?;
    idle_with_interrupts(&mut a)?;
    Ok(join(a.assemble(LOAD_ADDR)?, Layout { handlers }))
}

/// Enables this CPU's x2APIC through `IA32_APIC_BASE` and software-enables
/// it (spurious vector 0xff).
fn x2apic_enable(a: &mut CodeAssembler) -> Result<(), IcedError> {
    a.mov(ecx, MSR_APIC_BASE)?;
    a.rdmsr()?;
    a.or(eax, 0xc00_u32)?; // EN | EXTD
    a.wrmsr()?;
    a.mov(ecx, MSR_X2APIC_SVR)?;
    a.mov(eax, 0x1ff_u32)?; // software enable, spurious vector 0xff
    a.xor(edx, edx)?;
    a.wrmsr()
}

/// EOI through the x2APIC (clobbers eax, ecx, edx).
fn x2apic_eoi(a: &mut CodeAssembler) -> Result<(), IcedError> {
    a.mov(ecx, MSR_X2APIC_EOI)?;
    a.xor(eax, eax)?;
    a.xor(edx, edx)?;
    a.wrmsr()
}

/// Enables this CPU's x2APIC, software-enables it and puts the LVT timer in
/// TSC-deadline mode on `TIMER_VECTOR`, then arms the first deadline.
fn x2apic_timer_setup(a: &mut CodeAssembler) -> Result<(), IcedError> {
    x2apic_enable(a)?;
    a.mov(ecx, MSR_X2APIC_LVT_TIMER)?;
    a.mov(eax, (TIMER_VECTOR as u32) | (2 << 17))?; // TSC-deadline mode
    a.xor(edx, edx)?;
    a.wrmsr()?;
    arm_deadline(a)
}

/// `IA32_TSC_DEADLINE = rdtsc + params.TSC_PER_MS`.
fn arm_deadline(a: &mut CodeAssembler) -> Result<(), IcedError> {
    a.rdtsc()?;
    a.add(eax, dword_ptr(params(param::TSC_PER_MS)))?;
    a.adc(edx, 0_u32)?;
    a.mov(ecx, MSR_TSC_DEADLINE)?;
    a.wrmsr()
}

/// Handler: count a tick into `counter`, EOI through the x2APIC, re-arm.
fn deadline_handler(origin: u64, counter: u64) -> Result<Vec<u8>, IcedError> {
    let mut a = CodeAssembler::new(16)?;
    a.push(eax)?;
    a.push(ecx)?;
    a.push(edx)?;
    a.inc(dword_ptr(counter))?;
    x2apic_eoi(&mut a)?;
    arm_deadline(&mut a)?;
    a.pop(edx)?;
    a.pop(ecx)?;
    a.pop(eax)?;
    a.iret()?;
    a.assemble(origin)
}

fn tscdeadline() -> Result<Vec<u8>, IcedError> {
    let handlers = deadline_handler(HANDLER_BASE, results(result::BSP_TICKS))?;
    let mut a = CodeAssembler::new(16)?;
    prologue(&mut a, BSP_STACK)?;
    install(&mut a, TIMER_VECTOR, HANDLER_BASE)?;
    x2apic_timer_setup(&mut a)?;
    print(&mut a, "tscdeadline: x2apic timer armed\n")?;
    idle_with_interrupts(&mut a)?;
    Ok(join(a.assemble(LOAD_ADDR)?, Layout { handlers }))
}

/// The escape drill's attacker ([`Builtin::Drill`]).
fn drill() -> Result<Vec<u8>, IcedError> {
    use crate::defs::drill as d;
    let mut a = CodeAssembler::new(16)?;
    prologue(&mut a, BSP_STACK)?;
    let mut wait = a.create_label();
    let mut answer = a.create_label();
    a.set_label(&mut wait)?;
    a.pause()?;
    a.mov(eax, dword_ptr(params(param::ARG2)))?;
    a.test(eax, eax)?;
    a.je(wait)?;
    a.mov(eax, dword_ptr(params(param::ARG0)))?;
    a.mov(dx, u32::from(d::ADDR_LO_PORT))?;
    a.out(dx, eax)?;
    a.mov(eax, dword_ptr(params(param::ARG1)))?;
    a.mov(dx, u32::from(d::ADDR_HI_PORT))?;
    a.out(dx, eax)?;
    a.mov(eax, dword_ptr(params(param::ARG2)))?;
    a.mov(dx, u32::from(d::PORT))?;
    a.out(dx, al)?;
    a.mov(dx, u32::from(d::ANSWER_PORT))?;
    a.mov(di, (RESULTS_ADDR + result::DRILL_ANSWER) as u32)?;
    a.mov(cx, d::ANSWER_LEN)?;
    a.set_label(&mut answer)?;
    a.in_(al, dx)?;
    a.mov(byte_ptr(di), al)?;
    a.inc(di)?;
    a.dec(cx)?;
    a.jne(answer)?;
    a.mov(dword_ptr(params(param::ARG2)), 0_u32)?;
    a.inc(dword_ptr(results(result::DRILL_DONE)))?;
    a.jmp(wait)?;
    a.assemble(LOAD_ADDR)
}

fn memwriter() -> Result<Vec<u8>, IcedError> {
    let mut a = CodeAssembler::new(16)?;
    prologue(&mut a, BSP_STACK)?;
    print(&mut a, "memwriter: writing\n")?;
    // ebx = page index, esi = page count, edi = destination.
    a.xor(ebx, ebx)?;
    a.mov(esi, dword_ptr(params(param::ARG0)))?;
    a.mov(edi, dword_ptr(params(param::ARG1)))?;
    let mut fill = a.create_label();
    let mut filled = a.create_label();
    a.set_label(&mut fill)?;
    a.cmp(ebx, esi)?;
    a.jae(filled)?;
    a.mov(eax, ebx)?;
    a.xor(eax, 0x9e37_79b9_u32)?;
    a.mov(ecx, 1024_u32)?;
    // `rep stosd` with operand- and address-size prefixes: 32-bit ECX count,
    // es:[edi] (iced's `stosd()` would use di in 16-bit code).
    a.db(&[0xf3, 0x66, 0x67, 0xab])?;
    a.inc(ebx)?;
    a.jmp(fill)?;
    a.set_label(&mut filled)?;
    a.mov(dword_ptr(results(result::PATTERN_DONE)), 1_u32)?;
    print(&mut a, "memwriter: pattern done\n")?;
    // Loop: counter++, and with ARG2 != 0 write it into page counter % ARG0.
    let mut lp = a.create_label();
    let mut skip = a.create_label();
    a.xor(ebx, ebx)?; // page index for the dirtying loop
    a.set_label(&mut lp)?;
    a.inc(dword_ptr(results(result::LOOP_COUNTER)))?;
    a.cmp(dword_ptr(params(param::ARG2)), 0_u32)?;
    a.je(skip)?;
    a.cmp(esi, 0_u32)?;
    a.je(skip)?;
    a.mov(edi, ebx)?;
    a.shl(edi, 12_u32)?;
    a.add(edi, dword_ptr(params(param::ARG1)))?;
    a.mov(eax, dword_ptr(results(result::LOOP_COUNTER)))?;
    a.mov(dword_ptr(edi), eax)?;
    a.inc(ebx)?;
    a.cmp(ebx, esi)?;
    a.jb(skip)?;
    a.xor(ebx, ebx)?;
    a.set_label(&mut skip)?;
    a.jmp(lp)?;
    a.assemble(LOAD_ADDR)
}

fn smp() -> Result<Vec<u8>, IcedError> {
    let bsp_handler = deadline_handler(HANDLER_BASE, results(result::BSP_TICKS))?;
    let ap_handler_addr = HANDLER_BASE + 0x100;
    let ap_handler = deadline_handler(ap_handler_addr, results(result::AP_TICKS))?;
    let mut handlers = bsp_handler;
    assert!(handlers.len() <= 0x100);
    handlers.resize(0x100, 0xf4);
    handlers.extend_from_slice(&ap_handler);

    // BSP.
    let mut a = CodeAssembler::new(16)?;
    prologue(&mut a, BSP_STACK)?;
    print(&mut a, "smp: BSP up\n")?;
    a.mov(ecx, MSR_APIC_BASE)?;
    a.rdmsr()?;
    a.or(eax, 0xc00_u32)?;
    a.wrmsr()?;
    // INIT (level assert) to x2APIC id 1, then SIPI with vector AP_ENTRY_ADDR >> 12.
    a.mov(ecx, MSR_X2APIC_ICR)?;
    a.mov(edx, 1_u32)?;
    a.mov(eax, 0x4500_u32)?;
    a.wrmsr()?;
    a.mov(eax, 0x4600_u32 | (AP_ENTRY_ADDR >> 12) as u32)?;
    a.wrmsr()?;
    // Wait for the AP.
    let mut wait = a.create_label();
    a.set_label(&mut wait)?;
    a.pause()?;
    a.cmp(dword_ptr(results(result::AP_UP)), 1_u32)?;
    a.jne(wait)?;
    print(&mut a, "smp: 2 vCPUs up\n")?;
    install(&mut a, TIMER_VECTOR, HANDLER_BASE)?;
    x2apic_timer_setup(&mut a)?;
    idle_with_interrupts(&mut a)?;
    let main = a.assemble(LOAD_ADDR)?;

    // AP (entered at AP_ENTRY_ADDR with cs = AP_ENTRY_ADDR >> 4, ip = 0).
    let mut b = CodeAssembler::new(16)?;
    ap_prologue(&mut b, AP_STACK)?;
    print(&mut b, "smp: AP up\n")?;
    // Each CPU has its own IDT register, but in real mode both use the IVT at 0;
    // give the AP its own vector so the two handlers count separately.
    install(&mut b, TIMER_VECTOR + 1, ap_handler_addr)?;
    b.mov(ecx, MSR_APIC_BASE)?;
    b.rdmsr()?;
    b.or(eax, 0xc00_u32)?;
    b.wrmsr()?;
    b.mov(ecx, MSR_X2APIC_SVR)?;
    b.mov(eax, 0x1ff_u32)?;
    b.xor(edx, edx)?;
    b.wrmsr()?;
    b.mov(ecx, MSR_X2APIC_LVT_TIMER)?;
    b.mov(eax, (TIMER_VECTOR as u32 + 1) | (2 << 17))?;
    b.xor(edx, edx)?;
    b.wrmsr()?;
    arm_deadline(&mut b)?;
    b.mov(dword_ptr(results(result::AP_UP)), 1_u32)?;
    idle_with_interrupts(&mut b)?;
    // The AP's code runs with cs = 0x0900, so assemble it at ip 0.
    let ap = b.assemble(0)?;

    let mut img = join(main, Layout { handlers });
    let ap_off = (AP_ENTRY_ADDR - LOAD_ADDR) as usize;
    assert!(img.len() <= ap_off, "smp BSP code overlaps the AP entry");
    img.resize(ap_off, 0xf4);
    img.extend_from_slice(&ap);
    Ok(img)
}

fn fault() -> Result<Vec<u8>, IcedError> {
    const GDT: u64 = LOAD_ADDR + 0x200;
    const GDT_DESC: u64 = LOAD_ADDR + 0x220;
    const PM32: u64 = LOAD_ADDR + 0x300;
    const UD2_AT: u64 = PM32 + 0x80;
    let mut a = CodeAssembler::new(16)?;
    prologue(&mut a, BSP_STACK)?;
    print(&mut a, "fault: entering protected mode\n")?;
    // lgdt [GDT_DESC]
    a.db(&[0x0f, 0x01, 0x16])?;
    a.db(&(GDT_DESC as u16).to_le_bytes())?;
    a.mov(eax, cr0)?;
    a.or(eax, 1_u32)?;
    a.mov(cr0, eax)?;
    // jmp dword 0x08:PM32
    a.db(&[0x66, 0xea])?;
    a.db(&(PM32 as u32).to_le_bytes())?;
    a.db(&[0x08, 0x00])?;
    let mut img = a.assemble(LOAD_ADDR)?;
    img.resize((GDT - LOAD_ADDR) as usize, 0xf4);
    for d in [0_u64, 0x00cf_9a00_0000_ffff, 0x00cf_9200_0000_ffff] {
        img.extend_from_slice(&d.to_le_bytes());
    }
    img.resize((GDT_DESC - LOAD_ADDR) as usize, 0);
    img.extend_from_slice(&23_u16.to_le_bytes());
    img.extend_from_slice(&(GDT as u32).to_le_bytes());
    let mut b = CodeAssembler::new(32)?;
    b.mov(ax, 0x10_u32)?;
    b.mov(ds, ax)?;
    b.mov(ss, ax)?;
    b.mov(esp, BSP_STACK)?;
    b.push(0x2_u32)?; // eflags
    b.push(0x08_u32)?; // cs
    b.push(UD2_AT as u32)?; // eip
    b.iretd()?;
    let pm = b.assemble(PM32)?;
    img.resize((PM32 - LOAD_ADDR) as usize, 0xf4);
    img.extend_from_slice(&pm);
    img.resize((UD2_AT - LOAD_ADDR) as usize, 0xf4);
    img.extend_from_slice(&[0x0f, 0x0b]);
    Ok(img)
}
