//! Bounds on what loading a policy may cost the host before the policy ever runs.
//!
//! Compiling is the costly step, and its cost follows the shape of the binary: about
//! 5 KB of memory and 25 µs per function for Cranelift (200,000 empty functions took
//! 5 s and 1.1 GB here), about 4 bytes per byte of data segment, 10-40 per byte of
//! code, and 8 per byte of WAT text parsed. So the shape is measured on the binary,
//! without compiling it, and a policy past any bound is refused with
//! [`LoadError::CompileBound`] naming the bound. Every default is several times what the
//! largest shipped policy needs (the Python and JavaScript ones embed an interpreter:
//! about 13,400 functions, 9.2 MB of code, 11 MB of data, 14 modules, a 430 KB function),
//! and together they keep a load under 1 GiB and 10 s here: a policy at the bounds at
//! once (60,000 functions, 33 MiB of code, 31 MiB of data) took 7.1 s and 754 MiB on 2
//! cores.

use std::fmt;

/// Bounds on the shape of a policy's binary, each checked before it is compiled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompileBounds {
    /// Functions in all its core modules together. Default 65,536.
    pub functions: u64,
    /// Bytes of function bodies in all its core modules together. Default 32 MiB.
    pub code_bytes: u64,
    /// Bytes of the largest function body. Default 2 MiB.
    pub function_bytes: u64,
    /// Bytes of data segments in all its core modules together. Default 32 MiB.
    pub data_bytes: u64,
    /// Core modules in a component. Default 32.
    pub modules: u64,
    /// Bytes of WAT text, before it is parsed. Default 16 MiB.
    pub text_bytes: u64,
    /// Bytes of the policy as given (its file's size, checked before the file is read).
    /// Default 128 MiB: the sections the other bounds measure at their bounds, and room
    /// for names and debug information.
    pub file_bytes: u64,
}

impl Default for CompileBounds {
    fn default() -> Self {
        CompileBounds {
            functions: 65_536,
            code_bytes: 32 << 20,
            function_bytes: 2 << 20,
            data_bytes: 32 << 20,
            modules: 32,
            text_bytes: 16 << 20,
            file_bytes: 128 << 20,
        }
    }
}

/// One of the [`CompileBounds`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CompileBound {
    Functions,
    CodeBytes,
    FunctionBytes,
    DataBytes,
    Modules,
    TextBytes,
    FileBytes,
}

impl CompileBound {
    /// Every bound, in the order they are documented.
    pub const ALL: [CompileBound; 7] = [
        CompileBound::Functions,
        CompileBound::CodeBytes,
        CompileBound::FunctionBytes,
        CompileBound::DataBytes,
        CompileBound::Modules,
        CompileBound::TextBytes,
        CompileBound::FileBytes,
    ];

    /// Its name on the command line, in Python and in JSON: `functions`, `code-bytes`...
    pub fn name(self) -> &'static str {
        match self {
            CompileBound::Functions => "functions",
            CompileBound::CodeBytes => "code-bytes",
            CompileBound::FunctionBytes => "function-bytes",
            CompileBound::DataBytes => "data-bytes",
            CompileBound::Modules => "modules",
            CompileBound::TextBytes => "text-bytes",
            CompileBound::FileBytes => "file-bytes",
        }
    }

    /// The bound called `name` ([`CompileBound::name`]).
    pub fn named(name: &str) -> Option<CompileBound> {
        CompileBound::ALL.into_iter().find(|b| b.name() == name)
    }
}

impl fmt::Display for CompileBound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CompileBound::Functions => "functions",
            CompileBound::CodeBytes => "bytes of code",
            CompileBound::FunctionBytes => "bytes in one function",
            CompileBound::DataBytes => "bytes of data segments",
            CompileBound::Modules => "core modules",
            CompileBound::TextBytes => "bytes of WAT text",
            CompileBound::FileBytes => "bytes in its file",
        })
    }
}

impl CompileBounds {
    /// The value of one bound.
    pub fn get(&self, bound: CompileBound) -> u64 {
        match bound {
            CompileBound::Functions => self.functions,
            CompileBound::CodeBytes => self.code_bytes,
            CompileBound::FunctionBytes => self.function_bytes,
            CompileBound::DataBytes => self.data_bytes,
            CompileBound::Modules => self.modules,
            CompileBound::TextBytes => self.text_bytes,
            CompileBound::FileBytes => self.file_bytes,
        }
    }

    /// Set one bound.
    pub fn set(&mut self, bound: CompileBound, value: u64) {
        *match bound {
            CompileBound::Functions => &mut self.functions,
            CompileBound::CodeBytes => &mut self.code_bytes,
            CompileBound::FunctionBytes => &mut self.function_bytes,
            CompileBound::DataBytes => &mut self.data_bytes,
            CompileBound::Modules => &mut self.modules,
            CompileBound::TextBytes => &mut self.text_bytes,
            CompileBound::FileBytes => &mut self.file_bytes,
        } = value;
    }

    /// Refuse a policy of more than [`CompileBounds::file_bytes`], whatever it holds.
    pub(crate) fn check_file_len(&self, len: u64) -> Result<(), Exceeded> {
        self.within(CompileBound::FileBytes, len)
    }

    /// The bytes of the policy file at `path`, refused past
    /// [`CompileBounds::file_bytes`] before they are read ([`crate::input`]).
    pub(crate) fn read_file(&self, path: &std::path::Path) -> Result<Vec<u8>, ReadRefused> {
        crate::input::read_at_most(path, self.file_bytes).map_err(|refused| match refused {
            crate::input::TooLong::Io(error) => ReadRefused::Io(error),
            crate::input::TooLong::Bytes { len, limit } => ReadRefused::Bound(Exceeded {
                bound: CompileBound::FileBytes,
                asked: len,
                limit,
            }),
        })
    }

    /// Refuse WAT text longer than [`CompileBounds::text_bytes`] before parsing it.
    pub(crate) fn check_text(&self, text: &[u8]) -> Result<(), Exceeded> {
        self.within(CompileBound::TextBytes, text.len() as u64)
    }

    /// Measure a binary (a core module or a component, with every module inside it)
    /// and refuse it past any bound. Reads section headers and the length of each
    /// function body; decodes no instruction. A malformed binary is measured as far as
    /// it parses: compiling it reports what is wrong.
    pub(crate) fn check_binary(&self, binary: &[u8]) -> Result<(), Exceeded> {
        use wasmparser::{Parser, Payload};
        let mut seen = Shape::default();
        for payload in Parser::new(0).parse_all(binary) {
            match payload {
                Ok(Payload::ModuleSection { .. }) => seen.modules += 1,
                Ok(Payload::CodeSectionStart { count, size, .. }) => {
                    seen.functions += u64::from(count);
                    seen.code_bytes += u64::from(size);
                }
                Ok(Payload::CodeSectionEntry(body)) => {
                    let range = body.range();
                    let len = range.end - range.start;
                    seen.function_bytes = seen.function_bytes.max(len);
                }
                Ok(Payload::DataSection(data)) => {
                    for segment in data.into_iter().flatten() {
                        seen.data_bytes += segment.data.len() as u64;
                    }
                }
                Ok(_) => {}
                Err(_) => break,
            }
            // Checked as the parse goes, so that a binary far past a bound is refused
            // without reading the rest of it.
            seen.check(self)?;
        }
        Ok(())
    }

    fn within(&self, bound: CompileBound, asked: u64) -> Result<(), Exceeded> {
        let limit = self.get(bound);
        match asked <= limit {
            true => Ok(()),
            false => Err(Exceeded {
                bound,
                asked,
                limit,
            }),
        }
    }
}

/// A binary (or text) past one of the bounds: which, what it has, and the bound. A
/// load refuses it as [`crate::error::LoadError::CompileBound`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Exceeded {
    pub(crate) bound: CompileBound,
    pub(crate) asked: u64,
    pub(crate) limit: u64,
}

/// Why a policy file was not read: the OS said no, or it is past a bound.
#[derive(Debug)]
pub(crate) enum ReadRefused {
    Io(std::io::Error),
    Bound(Exceeded),
}

/// What a binary has, so far as it was read.
#[derive(Debug, Default)]
struct Shape {
    functions: u64,
    code_bytes: u64,
    function_bytes: u64,
    data_bytes: u64,
    modules: u64,
}

impl Shape {
    fn check(&self, bounds: &CompileBounds) -> Result<(), Exceeded> {
        bounds.within(CompileBound::Functions, self.functions)?;
        bounds.within(CompileBound::CodeBytes, self.code_bytes)?;
        bounds.within(CompileBound::FunctionBytes, self.function_bytes)?;
        bounds.within(CompileBound::DataBytes, self.data_bytes)?;
        bounds.within(CompileBound::Modules, self.modules)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn module(functions: usize, body_instructions: usize, data: usize) -> Vec<u8> {
        let body = "(drop (i32.const 1))".repeat(body_instructions);
        let funcs: String = (0..functions).map(|_| format!("(func {body})")).collect();
        wat::parse_str(format!(
            "(module (memory 1) {funcs} (data (i32.const 0) \"{}\"))",
            "a".repeat(data)
        ))
        .unwrap()
    }

    fn refused(bounds: &CompileBounds, binary: &[u8]) -> Option<(CompileBound, u64, u64)> {
        match bounds.check_binary(binary) {
            Ok(()) => None,
            Err(Exceeded {
                bound,
                asked,
                limit,
            }) => Some((bound, asked, limit)),
        }
    }

    #[test]
    fn each_bound_refuses_one_more_than_it_allows() {
        let tight = CompileBounds {
            functions: 10,
            code_bytes: 1000,
            function_bytes: 200,
            data_bytes: 100,
            modules: 1,
            text_bytes: 50,
            file_bytes: 60,
        };
        assert_eq!(refused(&tight, &module(10, 1, 100)), None);
        assert_eq!(
            refused(&tight, &module(11, 1, 0)),
            Some((CompileBound::Functions, 11, 10))
        );
        assert_eq!(
            refused(&tight, &module(1, 70, 0)).map(|r| r.0),
            Some(CompileBound::FunctionBytes)
        );
        let code = refused(&tight, &module(10, 40, 0));
        assert_eq!(code.map(|r| r.0), Some(CompileBound::CodeBytes), "{code:?}");
        assert_eq!(
            refused(&tight, &module(1, 1, 101)),
            Some((CompileBound::DataBytes, 101, 100))
        );
        assert!(tight.check_text(&[b' '; 50]).is_ok());
        assert!(matches!(
            tight.check_text(&[b' '; 51]),
            Err(Exceeded {
                bound: CompileBound::TextBytes,
                ..
            })
        ));
        assert!(tight.check_file_len(60).is_ok());
        assert!(matches!(
            tight.check_file_len(61),
            Err(Exceeded {
                bound: CompileBound::FileBytes,
                ..
            })
        ));
    }

    #[test]
    fn a_file_past_the_bound_is_refused_by_its_size_before_it_is_read() {
        let folder = std::env::temp_dir().join(format!("allocbox-bounds-{}", std::process::id()));
        std::fs::create_dir_all(&folder).unwrap();
        let path = folder.join("huge.wasm");
        // Sparse: 2 GiB that take no disk and would take 2 GiB to read.
        std::fs::File::create(&path)
            .unwrap()
            .set_len(2 << 30)
            .unwrap();
        let refused = CompileBounds::default().read_file(&path);
        assert!(
            matches!(
                refused,
                Err(ReadRefused::Bound(Exceeded {
                    bound: CompileBound::FileBytes,
                    asked: 2147483648,
                    ..
                }))
            ),
            "{refused:?}"
        );
        let small = folder.join("small.wat");
        std::fs::write(&small, "(component)").unwrap();
        assert_eq!(
            CompileBounds::default().read_file(&small).unwrap(),
            b"(component)"
        );
        std::fs::remove_dir_all(&folder).unwrap();
    }

    #[test]
    fn a_stream_past_the_bound_is_refused_after_one_byte_more_than_it_allows() {
        let bounds = CompileBounds {
            file_bytes: 10,
            ..CompileBounds::default()
        };
        // /dev/zero has no size: only reading finds it endless.
        let refused = bounds.read_file(std::path::Path::new("/dev/zero"));
        assert!(
            matches!(refused, Err(ReadRefused::Bound(Exceeded { asked: 11, .. }))),
            "{refused:?}"
        );
    }

    #[test]
    fn modules_inside_a_component_are_counted_together() {
        let component = wat::parse_str(
            "(component (core module (func) (func)) (core module (func)) (core module))",
        )
        .unwrap();
        let bounds = CompileBounds {
            functions: 3,
            modules: 3,
            ..CompileBounds::default()
        };
        assert_eq!(refused(&bounds, &component), None);
        let fewer = CompileBounds {
            functions: 2,
            ..bounds
        };
        assert_eq!(
            refused(&fewer, &component),
            Some((CompileBound::Functions, 3, 2))
        );
        let fewer = CompileBounds {
            modules: 2,
            ..bounds
        };
        assert_eq!(
            refused(&fewer, &component),
            Some((CompileBound::Modules, 3, 2))
        );
    }

    #[test]
    fn every_bound_has_a_name_that_finds_it() {
        for bound in CompileBound::ALL {
            assert_eq!(CompileBound::named(bound.name()), Some(bound));
        }
        assert_eq!(CompileBound::named("nope"), None);
    }
}
