//! Kinds of memory a policy may ask for (pages, NUMA placement, locking, guard pages,
//! GPU memory), and the grants an embedder gives, one per kind, by the names every
//! interface uses: one table ([`KindGrant::row`]) that the maps of `mapped` and the GPU
//! backends read, and every list a user reads is made of.

/// How a region's pages are backed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pages {
    Normal,
    /// Transparent huge pages, advised.
    TransparentHuge,
    /// Explicit huge pages from the kernel's reserved pool.
    Hugetlb,
}

/// Where a region's pages are placed among NUMA nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Numa {
    Any,
    Bind(u32),
    Interleave,
    Preferred(u32),
}

/// Where a region's inaccessible page lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guard {
    None,
    After,
    Before,
}

/// A kind of memory a policy asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kind {
    pub pages: Pages,
    pub numa: Numa,
    pub locked: bool,
    pub guard: Guard,
}

/// One kind of memory an embedder may grant, by its name in every interface: Rust,
/// the CLI's `--grant`, Python's `grant=`. What the host knows of each is its
/// [`KindRow`]: a kind is one variant here and one row in [`KindGrant::row`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KindGrant {
    Numa,
    HugePages,
    Locked,
    Guarded,
    Pinned,
    Device,
}

/// What the host knows of one kind of memory: every list a user reads and every
/// mapping of a GPU kind is made from these rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KindRow {
    /// Its name in every interface and list.
    pub name: &'static str,
    pub maps: Maps,
}

/// How a policy gets memory of a kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Maps {
    /// A property of the host pages `memory.map-region`'s kind asks for.
    HostPages,
    /// A region of its own from a GPU's driver, asked for with `memory.map-gpu`.
    Gpu(GpuRow),
}

/// How the host makes, shares out and places one kind of GPU memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuRow {
    pub made_by: MadeBy,
    /// Its bytes are host memory, read and written like any region's (a host handler's
    /// policy may map it); otherwise they are on the handler's GPU, no host code touches
    /// them, and only a device handler's policy may map it.
    pub host_memory: bool,
    /// The process-wide share its bytes are taken from ([`crate::shares`]).
    pub share: Share,
}

/// Who makes a GPU kind's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MadeBy {
    /// The host maps ordinary pages and registers them with the driver; unregistered
    /// and unmapped when given back.
    HostRegistered,
    /// The driver allocates it (on the handler's GPU, or GPU 0 for a host handler), and
    /// takes it back.
    Driver,
}

/// The process-wide share a GPU kind's bytes come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Share {
    /// Host memory pinned for every GPU ([`crate::shares::pinned_share`]).
    Pinned,
    /// What the GPU had free ([`crate::shares::DEVICE_SHARE`] of it).
    Device,
}

impl KindGrant {
    pub const ALL: [KindGrant; 6] = [
        KindGrant::Numa,
        KindGrant::HugePages,
        KindGrant::Locked,
        KindGrant::Guarded,
        KindGrant::Pinned,
        KindGrant::Device,
    ];

    /// The kind's row: the one place that says what it is.
    pub const fn row(self) -> KindRow {
        const fn pages(name: &'static str) -> KindRow {
            KindRow {
                name,
                maps: Maps::HostPages,
            }
        }
        const fn gpu(
            name: &'static str,
            made_by: MadeBy,
            host_memory: bool,
            share: Share,
        ) -> KindRow {
            let row = GpuRow {
                made_by,
                host_memory,
                share,
            };
            KindRow {
                name,
                maps: Maps::Gpu(row),
            }
        }
        match self {
            KindGrant::Numa => pages("numa"),
            KindGrant::HugePages => pages("huge-pages"),
            KindGrant::Locked => pages("locked"),
            KindGrant::Guarded => pages("guarded"),
            // For a policy placing a NumPy program's arrays that it hands to PyTorch,
            // CuPy or Numba's CUDA: copies between them and a GPU run as DMA.
            KindGrant::Pinned => gpu("pinned", MadeBy::HostRegistered, true, Share::Pinned),
            // What a device handler (a GPU program's arrays, tensors, buffers) lends from.
            KindGrant::Device => gpu("device", MadeBy::Driver, false, Share::Device),
        }
    }

    pub fn name(self) -> &'static str {
        self.row().name
    }

    /// Its bit in [`KindGrants`].
    const fn bit(self) -> u32 {
        1 << self as u32
    }
}

/// Every kind's name, as a sentence lists them (`numa, huge-pages, ... or device`): what
/// every list a user reads (errors, `--grant`'s help) is made of, so none goes stale when
/// a kind is added.
pub fn kind_list() -> String {
    let names: Vec<&str> = KindGrant::ALL.iter().map(|g| g.name()).collect();
    match names.split_last() {
        Some((last, [])) => (*last).to_string(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

impl std::fmt::Display for KindGrant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The kinds of memory a policy may ask the host for. Nothing by default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KindGrants(u32);

impl KindGrants {
    pub fn grant(&mut self, kind: KindGrant) {
        self.0 |= kind.bit();
    }

    pub fn granted(&self, kind: KindGrant) -> bool {
        self.0 & kind.bit() != 0
    }

    /// Grants from names (`["numa", "guarded"]`), refusing an unknown one.
    /// The first grant `kind` needs that is not given.
    pub(crate) fn missing_for(&self, kind: &Kind) -> Option<KindGrant> {
        let needs = [
            (kind.pages != Pages::Normal, KindGrant::HugePages),
            (kind.numa != Numa::Any, KindGrant::Numa),
            (kind.locked, KindGrant::Locked),
            (kind.guard != Guard::None, KindGrant::Guarded),
        ];
        needs
            .into_iter()
            .find(|&(needed, grant)| needed && !self.granted(grant))
            .map(|(_, grant)| grant)
    }
}

impl FromIterator<KindGrant> for KindGrants {
    fn from_iter<I: IntoIterator<Item = KindGrant>>(kinds: I) -> Self {
        let mut grants = KindGrants::default();
        for kind in kinds {
            grants.grant(kind);
        }
        grants
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_its_own_name_and_bit() {
        let mut names: Vec<_> = KindGrant::ALL.iter().map(|k| k.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), KindGrant::ALL.len());
        let all: KindGrants = KindGrant::ALL.into_iter().collect();
        for kind in KindGrant::ALL {
            assert!(all.granted(kind));
            let one: KindGrants = [kind].into_iter().collect();
            let others = KindGrant::ALL.into_iter().filter(|&k| k != kind);
            assert!(one.granted(kind) && others.clone().all(|k| !one.granted(k)));
        }
    }

    /// Pages the host maps are host memory: a kind made of them that claimed otherwise
    /// would let the host refuse its own bytes, or a device handler lend them.
    #[test]
    fn a_kind_of_registered_host_pages_is_host_memory_from_the_pinned_share() {
        for kind in KindGrant::ALL {
            if let Maps::Gpu(row) = kind.row().maps
                && row.made_by == MadeBy::HostRegistered
            {
                assert!(row.host_memory, "{kind}");
                assert_eq!(row.share, Share::Pinned, "{kind}");
            }
        }
    }
}
