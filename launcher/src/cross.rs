//! Jobs across instruction sets (`--arch`): which architecture each rank's
//! VM emulates (which build of a program each runs: [`dmlc_vm::program_for`]).

use dmlc_vm::Arch;

/// Parses `--arch`: one architecture, or one per rank, comma-separated.
pub fn parse_arches(s: &str) -> Result<Vec<Arch>, String> {
    Arch::parse_list(s).map_err(|e| e.to_string())
}

/// The architecture of rank `rank`: `list` holds none (the host's), one
/// (every rank's) or one per rank.
pub fn arch_of(list: &[Arch], rank: usize) -> Arch {
    match list {
        [] => Arch::host(),
        [one] => *one,
        many => many.get(rank).copied().unwrap_or_else(Arch::host),
    }
}

/// The distinct architectures of ranks `ranks`, in first-use order.
pub fn distinct(list: &[Arch], ranks: std::ops::Range<usize>) -> Vec<Arch> {
    let mut seen = Vec::new();
    for r in ranks {
        let a = arch_of(list, r);
        if !seen.contains(&a) {
            seen.push(a);
        }
    }
    seen
}

/// `Vec<Arch>` as a list of names, for a job sent to the other hosts.
pub mod arch_names {
    use dmlc_vm::Arch;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(list: &[Arch], s: S) -> Result<S::Ok, S::Error> {
        let names: Vec<&str> = list.iter().map(|a| a.name()).collect();
        names.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Arch>, D::Error> {
        Vec::<String>::deserialize(d)?
            .iter()
            .map(|n| n.parse().map_err(serde::de::Error::custom))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_take_the_one_arch_or_their_own() {
        let mixed = [Arch::X86_64, Arch::Aarch64, Arch::Riscv64];
        assert_eq!(arch_of(&[], 3), Arch::host());
        assert_eq!(arch_of(&[Arch::Riscv64], 5), Arch::Riscv64);
        assert_eq!(arch_of(&mixed, 1), Arch::Aarch64);
        assert_eq!(distinct(&mixed, 1..3), [Arch::Aarch64, Arch::Riscv64]);
        assert_eq!(distinct(&[Arch::Aarch64], 0..4), [Arch::Aarch64]);
        assert!(parse_arches("x86_64,mips")
            .unwrap_err()
            .contains("\"mips\""));
    }
}
