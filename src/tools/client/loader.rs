//! The client side of the ABI: open the plugin the way NCCL does and call it through its
//! exported tables, and capture what it logs through the logger NCCL would hand it. Used by the
//! `ferroce` tool and the tests (through [`crate::driver`]); the plugin itself never calls this.
//!
//! The capture is process-wide, as NCCL's logger is: [`CAPTURED`] collects every line of every
//! plugin opened in this process, and [`ECHO`] says whether they also go to stderr.

use std::ffi::{CStr, CString, c_char, c_int, c_ulong, c_void};
use std::sync::Mutex;

use ferroce::ffi::abi::{ncclDebugLogLevel, ncclDebugLogger_t};

/// A `dlopen`ed plugin library; `dlclose`d on drop.
pub struct Library {
    handle: *mut c_void,
    /// The name under which `dlopen` succeeded.
    pub opened_as: String,
}

fn dlerror() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl call.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-NULL, NUL-terminated (see above).
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

impl Library {
    /// Opens `name` as NCCL does for `NCCL_NET_PLUGIN=<name>`: first exactly as written, then,
    /// for a bare name not of the form `lib*.so`, as `libnccl-net-<name>.so`. Both go through
    /// the normal dynamic-loader search (`LD_LIBRARY_PATH`, …) with `RTLD_NOW | RTLD_LOCAL`.
    pub fn open_like_nccl(name: &str) -> Result<Library, String> {
        let mut tried = vec![name.to_string()];
        let first = Self::open(name);
        if first.is_ok() || name.contains('/') || (name.starts_with("lib") && name.ends_with(".so"))
        {
            return first;
        }
        let second = format!("libnccl-net-{name}.so");
        tried.push(second.clone());
        Self::open(&second).map_err(|e| format!("could not open any of {tried:?}: {e}"))
    }

    /// `dlopen(path, RTLD_NOW | RTLD_LOCAL)`.
    pub fn open(path: &str) -> Result<Library, String> {
        let c = CString::new(path).map_err(|_| format!("{path:?} contains NUL"))?;
        // SAFETY: c is a valid C string; the flags are valid dlopen flags.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(format!("dlopen({path}): {}", dlerror()));
        }
        Ok(Library { handle, opened_as: path.to_string() })
    }

    /// The exported table `symbol`, typed as `T`.
    ///
    /// # Safety
    /// `T` must be the type of the exported object named `symbol`, and the reference must not
    /// be used after this `Library` is dropped.
    pub unsafe fn table<T>(&self, symbol: &CStr) -> Option<&T> {
        // SAFETY: handle is open; symbol is a valid C string.
        let p = unsafe { libc::dlsym(self.handle, symbol.as_ptr()) };
        // SAFETY: the caller promises the symbol's type; dlsym gave NULL or its address.
        unsafe { p.cast::<T>().as_ref() }
    }
}

impl Library {
    /// The `name` member of the exported table `ncclNetPlugin_v{version}`; `None` where the
    /// library lacks that symbol.
    pub fn table_name(&self, version: u32) -> Option<String> {
        let sym = CString::new(format!("ncclNetPlugin_v{version}")).expect("no NUL");
        // SAFETY: every version's table starts with `const char* name`; only that is read, and
        // not after `self` is dropped.
        let name = unsafe { self.table::<*const c_char>(&sym) }?;
        // SAFETY: the name member is NULL or points to a static NUL-terminated string.
        (!name.is_null()).then(|| unsafe { CStr::from_ptr(*name) }.to_string_lossy().into_owned())
    }
}

/// `file` beside this program, where `ci/build.sh` puts the tool and the plugin, if it is
/// there.
pub fn beside_me(file: &str) -> Option<String> {
    let p = std::env::current_exe().ok()?.parent()?.join(file);
    p.exists().then(|| p.to_string_lossy().into_owned())
}

/// The plugin a tool loads when not told: `libnccl-net-ferroce.so` beside this program, else
/// `ferroce` as NCCL would look it up.
pub fn default_plugin() -> String {
    beside_me("libnccl-net-ferroce.so").unwrap_or_else(|| "ferroce".into())
}

impl Drop for Library {
    fn drop(&mut self) {
        // SAFETY: handle came from dlopen and is closed once.
        if unsafe { libc::dlclose(self.handle) } != 0 {
            eprintln!("dlclose({}): {}", self.opened_as, dlerror());
        }
    }
}

/// Everything a plugin logged through [`capture_logger`], as (level, flags, message).
pub static CAPTURED: Mutex<Vec<(i32, u64, String)>> = Mutex::new(Vec::new());

/// Whether captured lines are also echoed to stderr.
pub static ECHO: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// The non-variadic shape of NCCL's logger as the plugin calls it: format `"%s"` plus one
/// string argument.
extern "C" fn capture(
    level: ncclDebugLogLevel,
    flags: c_ulong,
    _file: *const c_char,
    _line: c_int,
    fmt: *const c_char,
    arg: *const c_char,
) {
    let text = |p: *const c_char| {
        if p.is_null() {
            String::from("(null)")
        } else {
            // SAFETY: the plugin passes NUL-terminated strings (or NULL, handled above).
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    let fmt = text(fmt);
    // The test of well-formed logging: the format is always exactly "%s".
    let msg = if fmt == "%s" { text(arg) } else { format!("BAD FORMAT {fmt:?}") };
    if ECHO.load(std::sync::atomic::Ordering::Relaxed) {
        say(format!("[plugin level {}] {msg}\n", level.0));
    }
    CAPTURED.lock().unwrap_or_else(|p| p.into_inner()).push((level.0 as i32, flags, msg));
}

/// A logger to hand the plugin's `init`, recording every line in [`CAPTURED`].
pub fn capture_logger() -> ncclDebugLogger_t {
    type Fixed = extern "C" fn(
        ncclDebugLogLevel,
        c_ulong,
        *const c_char,
        c_int,
        *const c_char,
        *const c_char,
    );
    // SAFETY: on x86-64 System V a variadic call passes its arguments exactly as a fixed-arity
    // call does (integer registers in order; %al only tells the callee how many vector
    // registers were used), and the plugin always passes exactly one argument after the format.
    // Stable Rust cannot define a C-variadic function, so this is how a Rust test receives it.
    Some(unsafe {
        std::mem::transmute::<
            Fixed,
            unsafe extern "C" fn(
                ncclDebugLogLevel,
                c_ulong,
                *const c_char,
                c_int,
                *const c_char,
                ...
            ),
        >(capture)
    })
}

/// Takes the captured lines, leaving the buffer empty.
pub fn take_captured() -> Vec<(i32, u64, String)> {
    std::mem::take(&mut *CAPTURED.lock().unwrap_or_else(|p| p.into_inner()))
}

/// Shows what the plugin warned about (and its INFO lines when `NCCL_DEBUG` is `INFO` or
/// `TRACE`, as NCCL would) on stderr, and keeps the capture from growing: for the tools' long
/// runs, whose ranks do not echo every line as it comes.
pub fn flush_log() {
    let info = std::env::var("NCCL_DEBUG")
        .is_ok_and(|v| v.eq_ignore_ascii_case("INFO") || v.eq_ignore_ascii_case("TRACE"));
    for (level, _, line) in take_captured() {
        match level {
            ..=2 => say(format!("plugin {}: {line}\n", if level == 2 { "WARN" } else { "ERROR" })),
            3 if info => say(format!("plugin INFO: {line}\n")),
            _ => {}
        }
    }
}

/// Writes `line` to stderr in one write: the ranks of a run share one pipe, and `eprintln!`
/// writes a line in pieces, which another rank's line can come between (a reader then sees two
/// lines joined into one; the cluster test once counted 7 connections of 8 so). A write of up
/// to a pipe's 4 KiB is never split.
fn say(line: String) {
    use std::io::Write;
    // Nowhere to report a failed write to stderr.
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}
