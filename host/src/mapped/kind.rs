//! Kinds of memory a policy may ask for (pages, NUMA placement, locking, guard pages),
//! and the grants an embedder gives, one per kind, by the names every interface uses.

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
/// the CLI's `--grant`, Python's `grant=`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KindGrant {
    Numa,
    HugePages,
    Locked,
    Guarded,
    /// Host pages registered with the GPU driver (`memory.map-pinned`).
    Pinned,
    /// Memory on the GPU a device handler serves (`memory.map-device`).
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

    pub fn name(self) -> &'static str {
        match self {
            KindGrant::Numa => "numa",
            KindGrant::HugePages => "huge-pages",
            KindGrant::Locked => "locked",
            KindGrant::Guarded => "guarded",
            KindGrant::Pinned => "pinned",
            KindGrant::Device => "device",
        }
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

/// A grant name that is none of [`KindGrant::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{given}` is not a kind of memory allocbox can grant: use {}",
    kind_list()
)]
pub struct UnknownGrant {
    pub given: String,
}

impl std::str::FromStr for KindGrant {
    type Err = UnknownGrant;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        KindGrant::ALL
            .into_iter()
            .find(|g| g.name() == s)
            .ok_or_else(|| UnknownGrant {
                given: crate::untrusted::escape(s),
            })
    }
}

/// The kinds of memory a policy may ask the host for. Nothing by default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KindGrants {
    pub numa: bool,
    pub huge_pages: bool,
    pub locked: bool,
    pub guarded: bool,
    pub pinned: bool,
    pub device: bool,
}

impl KindGrants {
    pub fn grant(&mut self, kind: KindGrant) {
        *self.flag(kind) = true;
    }

    pub fn granted(&self, kind: KindGrant) -> bool {
        match kind {
            KindGrant::Numa => self.numa,
            KindGrant::HugePages => self.huge_pages,
            KindGrant::Locked => self.locked,
            KindGrant::Guarded => self.guarded,
            KindGrant::Pinned => self.pinned,
            KindGrant::Device => self.device,
        }
    }

    fn flag(&mut self, kind: KindGrant) -> &mut bool {
        match kind {
            KindGrant::Numa => &mut self.numa,
            KindGrant::HugePages => &mut self.huge_pages,
            KindGrant::Locked => &mut self.locked,
            KindGrant::Guarded => &mut self.guarded,
            KindGrant::Pinned => &mut self.pinned,
            KindGrant::Device => &mut self.device,
        }
    }

    /// Grants from names (`["numa", "guarded"]`), refusing an unknown one.
    pub fn from_names<S: AsRef<str>>(
        names: impl IntoIterator<Item = S>,
    ) -> Result<Self, UnknownGrant> {
        let mut grants = KindGrants::default();
        for name in names {
            grants.grant(name.as_ref().parse()?);
        }
        Ok(grants)
    }

    /// The first grant `kind` needs that is not given.
    pub(super) fn missing_for(&self, kind: &Kind) -> Option<KindGrant> {
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
