//! A filter's allow-list compiled to classic BPF as a binary search over
//! call-number ranges.
//!
//! `seccompiler` turns a filter into a linear chain: one comparison block
//! per listed call, so a call is decided after up to 3 × (listed calls)
//! instructions. The kernel runs each new filter once per call number when
//! it attaches it (`seccomp_cache_prepare`: it caches the calls the filter
//! always allows, so those never run it again), which made attaching the
//! control filter cost ~0.35 ms and each vCPU filter 70–130 µs — on the way
//! to a VM's first guest instruction (`benches/benches/seccomp.rs`,
//! CHALLENGES.md "Attaching a seccomp filter costs its length times the call
//! numbers"). Here the listed calls become ranges (neighbouring calls merge),
//! and a call is decided after log2(ranges) comparisons.
//!
//! The verdicts are seccompiler's: the architecture check and the argument
//! rules are its code (a rule block is `BpfProgram::from(SeccompRule)`, as in
//! its chain), and the tests compare both programs on every call number and
//! on the argument values the rules name.

use std::collections::BTreeMap;

use seccompiler::{BpfProgram, SeccompAction, SeccompRule, sock_filter};

// Classic BPF opcodes (class | op | source, linux/bpf_common.h) and
// seccomp_data offsets.
const BPF_LD_W_ABS: u16 = 0x20;
const BPF_JMP_JA: u16 = 0x05;
const BPF_JMP_JGE_K: u16 = 0x35;
const BPF_JMP_JEQ_K: u16 = 0x15;
const BPF_RET_K: u16 = 0x06;
const DATA_NR: u32 = 0;
const DATA_ARCH: u32 = 4;
const AUDIT_ARCH_X86_64: u32 = 62 | 0x8000_0000 | 0x4000_0000;
/// The kernel's limit (BPF_MAXINSNS).
const MAX_LEN: usize = 4096;

/// Why a program cannot be built (a bug in the lists).
#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    /// A call number that no call has.
    #[error("call number {0} is out of range")]
    BadNumber(i64),
    /// Longer than the kernel takes.
    #[error("the program has {0} instructions, more than the kernel's 4096")]
    TooLong(usize),
}

/// What the filter does with the calls of one range.
enum Leaf {
    Allow,
    Deny,
    /// The call's argument rules (one call number only).
    Rules(BpfProgram),
}

fn stmt(code: u16, k: u32) -> sock_filter {
    sock_filter { code, jt: 0, jf: 0, k }
}

fn jump(code: u16, k: u32, jt: u8, jf: u8) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

/// Builds the program: `matched` for a listed call whose rules (if any)
/// match, `mismatch` for every other call, the process killed for another
/// architecture (as seccompiler does).
pub(super) fn compile(
    rules: BTreeMap<i64, Vec<SeccompRule>>,
    mismatch: SeccompAction,
    matched: SeccompAction,
) -> Result<BpfProgram, TreeError> {
    let (deny, allow) = (u32::from(mismatch), u32::from(matched));
    // Ranges as (first call number, leaf), sorted, covering 0..=u32::MAX.
    let mut ranges: Vec<(u32, Leaf)> = Vec::new();
    let mut next = 0u64; // the first number not yet covered
    for (nr, chain) in rules {
        let n = u32::try_from(nr).map_err(|_| TreeError::BadNumber(nr))?;
        if u64::from(n) > next {
            ranges.push((next as u32, Leaf::Deny));
        }
        if chain.is_empty() {
            match ranges.last() {
                Some((_, Leaf::Allow)) if u64::from(n) == next => {}
                _ => ranges.push((n, Leaf::Allow)),
            }
        } else {
            let mut block = BpfProgram::new();
            for rule in chain {
                block.extend(BpfProgram::from(rule));
                block.push(stmt(BPF_RET_K, allow));
            }
            block.push(stmt(BPF_RET_K, deny));
            ranges.push((n, Leaf::Rules(block)));
        }
        next = u64::from(n) + 1;
    }
    if next <= u64::from(u32::MAX) {
        ranges.push((next as u32, Leaf::Deny));
    }
    let mut prog = vec![
        stmt(BPF_LD_W_ABS, DATA_ARCH),
        jump(BPF_JMP_JEQ_K, AUDIT_ARCH_X86_64, 1, 0),
        stmt(BPF_RET_K, libc::SECCOMP_RET_KILL_PROCESS),
        stmt(BPF_LD_W_ABS, DATA_NR),
    ];
    search(&ranges, allow, deny, &mut prog);
    if prog.len() > MAX_LEN {
        return Err(TreeError::TooLong(prog.len()));
    }
    Ok(prog)
}

/// Appends the code deciding among `ranges` (the call number in A).
fn search(ranges: &[(u32, Leaf)], allow: u32, deny: u32, out: &mut BpfProgram) {
    match ranges {
        [] => out.push(stmt(BPF_RET_K, deny)),
        [(_, leaf)] => match leaf {
            Leaf::Allow => out.push(stmt(BPF_RET_K, allow)),
            Leaf::Deny => out.push(stmt(BPF_RET_K, deny)),
            Leaf::Rules(block) => out.extend(block.iter().cloned()),
        },
        _ => {
            let mid = ranges.len() / 2;
            let split = ranges[mid].0;
            // [A >= split ? fall through : skip the upper half][upper][lower];
            // jumps go forward only, and a conditional one 255 at most.
            let mut upper = BpfProgram::new();
            search(&ranges[mid..], allow, deny, &mut upper);
            match u8::try_from(upper.len()) {
                Ok(skip) => out.push(jump(BPF_JMP_JGE_K, split, 0, skip)),
                Err(_) => {
                    out.push(jump(BPF_JMP_JGE_K, split, 1, 0));
                    out.push(stmt(BPF_JMP_JA, upper.len() as u32));
                }
            }
            out.extend(upper);
            search(&ranges[..mid], allow, deny, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use seccompiler::{SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, TargetArch};

    /// A classic BPF interpreter for what both compilers emit; also counts
    /// the instructions run (what the kernel's cache preparation pays).
    fn run(prog: &[sock_filter], nr: u32, arch: u32, args: [u64; 6]) -> (u32, usize) {
        let (mut a, mut pc, mut steps) = (0u32, 0usize, 0usize);
        loop {
            let i = &prog[pc];
            steps += 1;
            pc += 1;
            match i.code {
                0x20 => {
                    a = match i.k {
                        0 => nr,
                        4 => arch,
                        k @ 16..=63 => {
                            let arg = args[(k as usize - 16) / 8];
                            if k % 8 == 0 { arg as u32 } else { (arg >> 32) as u32 }
                        }
                        k => panic!("load of offset {k}"),
                    }
                }
                0x54 => a &= i.k,
                0x05 => pc += i.k as usize,
                0x15 | 0x25 | 0x35 | 0x45 => {
                    let t = match i.code {
                        0x15 => a == i.k,
                        0x25 => a > i.k,
                        0x35 => a >= i.k,
                        _ => a & i.k != 0,
                    };
                    pc += usize::from(if t { i.jt } else { i.jf });
                }
                0x06 => return (i.k, steps),
                c => panic!("opcode {c:#x}"),
            }
        }
    }

    fn both(rules: BTreeMap<i64, Vec<SeccompRule>>, mismatch: SeccompAction) -> (BpfProgram, BpfProgram) {
        let tree = compile(rules.clone(), mismatch.clone(), SeccompAction::Allow).unwrap();
        let linear = BpfProgram::try_from(
            SeccompFilter::new(rules, mismatch, SeccompAction::Allow, TargetArch::x86_64).unwrap(),
        )
        .unwrap();
        (tree, linear)
    }

    fn numbers() -> Vec<u32> {
        let mut v: Vec<u32> = (0..1100).collect();
        v.extend([
            0x4000_0000,
            0x4000_0001,
            0x4000_0010,
            0x7fff_ffff,
            u32::MAX - 1,
            u32::MAX,
        ]);
        v
    }

    /// The verdicts of both compilers agree on every call number, and the
    /// tree's cost is a fraction of the chain's. Returns (tree, chain)
    /// instructions run over all call numbers.
    fn agree(rules: BTreeMap<i64, Vec<SeccompRule>>, arg_values: &[u64]) -> (usize, usize) {
        let (tree, linear) = both(rules, SeccompAction::Trap);
        let (mut t_steps, mut l_steps) = (0, 0);
        for nr in numbers() {
            for &v in arg_values.iter().chain([0u64, u64::MAX].iter()) {
                let args = [3, v, v >> 1, 0, 0, 0];
                let (t, ts) = run(&tree, nr, AUDIT_ARCH_X86_64, args);
                let (l, ls) = run(&linear, nr, AUDIT_ARCH_X86_64, args);
                assert_eq!(t, l, "call {nr} args {args:x?}");
                t_steps += ts;
                l_steps += ls;
            }
            for arch in [0x4000_0003u32, 0] {
                assert_eq!(
                    run(&tree, nr, arch, [0; 6]).0,
                    libc::SECCOMP_RET_KILL_PROCESS,
                    "call {nr} from arch {arch:#x}"
                );
            }
        }
        (t_steps, l_steps)
    }

    fn allow_list(calls: &[&[super::super::lists::Allowed]]) -> BTreeMap<i64, Vec<SeccompRule>> {
        let mut rules = BTreeMap::new();
        for list in calls {
            for &(nr, _) in *list {
                rules.insert(nr, vec![]);
            }
        }
        rules
    }

    fn ioctl_rules(ioctls: &[(u64, u64, &str)]) -> Vec<SeccompRule> {
        ioctls
            .iter()
            .map(|&(mask, value, _)| {
                let c = SeccompCondition::new(1, SeccompCmpArgLen::Dword, SeccompCmpOp::MaskedEq(mask), value).unwrap();
                SeccompRule::new(vec![c]).unwrap()
            })
            .collect()
    }

    #[test]
    fn the_three_filters_decide_like_seccompiler_at_a_fraction_of_the_cost() {
        use super::super::lists::*;
        let worker_ioctl_values: Vec<u64> = WORKER_IOCTLS
            .iter()
            .flat_map(|&(mask, value, _)| [value, value ^ 1, value | !mask, value ^ 0x100])
            .collect();
        let mut worker = allow_list(&[WORKER]);
        worker.insert(libc::SYS_ioctl, ioctl_rules(WORKER_IOCTLS));
        for (name, rules, values) in [
            ("control", allow_list(&[WORKER, VCPU_EXTRA, CONTROL_EXTRA]), vec![]),
            ("vcpu", allow_list(&[WORKER, VCPU_EXTRA]), vec![]),
            ("worker", worker, worker_ioctl_values),
        ] {
            let calls = rules.len();
            let (tree_steps, chain_steps) = agree(rules.clone(), &values);
            let (tree, linear) = both(rules, SeccompAction::Trap);
            eprintln!(
                "{name}: {calls} calls, tree {} insns / {tree_steps} run, chain {} insns / {chain_steps} run",
                tree.len(),
                linear.len()
            );
            // A regression to a chain would fail these.
            assert!(tree_steps * 5 < chain_steps, "{name}: {tree_steps} vs {chain_steps}");
            assert!(tree.len() < linear.len(), "{name}");
        }
    }

    #[test]
    fn log_mode_and_edges_decide_like_seccompiler() {
        // The last and first numbers, neighbours that merge, a rule block in
        // the middle of a range.
        let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
        for nr in [0, 1, 2, 5, 7, 8, 9, 400, 1099] {
            rules.insert(nr, vec![]);
        }
        rules.insert(6, ioctl_rules(&[(0xff, 0x11, ""), (0xffff_ffff, 0x1234, "")]));
        agree(rules.clone(), &[0x11, 0x211, 0x1234, 0x1235]);
        let (tree, linear) = both(rules, SeccompAction::Log);
        for nr in numbers() {
            let args = [0, 0x1234, 0, 0, 0, 0];
            assert_eq!(
                run(&tree, nr, AUDIT_ARCH_X86_64, args).0,
                run(&linear, nr, AUDIT_ARCH_X86_64, args).0
            );
        }
        // Nothing listed: everything denied.
        agree(BTreeMap::new(), &[]);
    }

    #[test]
    fn long_upper_halves_use_a_long_jump() {
        // Every other call with argument rules: the upper half of the first
        // split is far longer than a conditional jump reaches.
        let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
        for nr in (0..200).step_by(2) {
            rules.insert(nr, ioctl_rules(&[(0xffff, nr as u64, ""), (0xff00, 0xaf00, "")]));
        }
        let (tree, _) = both(rules.clone(), SeccompAction::Trap);
        assert!(
            tree.iter().any(|i| i.code == BPF_JMP_JA && i.k > 255),
            "no long jump was needed"
        );
        agree(rules, &[4, 0xaf17, 0x1_0004, 198]);
    }

    #[test]
    fn a_negative_call_number_is_refused() {
        let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
        rules.insert(-1, vec![]);
        let e = compile(rules, SeccompAction::Trap, SeccompAction::Allow).unwrap_err();
        assert_eq!(e.to_string(), "call number -1 is out of range");
    }
}
