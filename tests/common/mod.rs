//! Shared helpers of the integration tests: find the built plugin and load it as NCCL would.
#![allow(dead_code)] // each test target uses a different subset

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, OnceLock};

use ferroce::ffi::loader::Library;

/// Serialises tests that change the process environment or the plugin's global state.
pub static SERIAL: Mutex<()> = Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// `target/<profile>`, found from the test executable (`target/<profile>/deps/<test>`).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent().and_then(|d| d.parent()).expect("target/<profile>").to_path_buf()
}

/// A directory holding the plugin under the name NCCL looks for, `libnccl-net-ferroce.so`.
///
/// `FERROCE_PLUGIN_DIR` names a prebuilt one (the VM tests, which must not run cargo). Otherwise
/// `cargo test` does not build the cdylib, so it is built here (a no-op when fresh) and copied.
pub fn plugin_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(dir) = std::env::var_os("FERROCE_PLUGIN_DIR") {
            let dir = PathBuf::from(dir);
            assert!(dir.join("libnccl-net-ferroce.so").exists(), "no plugin in {}", dir.display());
            return dir;
        }
        let out = Command::new(env!("CARGO"))
            .args(["build", "--lib", "--message-format=json"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .expect("run cargo build --lib");
        assert!(
            out.status.success(),
            "cargo build --lib: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let built = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.contains("\"compiler-artifact\"") && l.contains("libferroce.so"))
            .flat_map(|l| l.split('"'))
            .find(|s| s.ends_with("/libferroce.so"))
            .map(PathBuf::from)
            .expect("cargo reported no libferroce.so");
        let dir = target_dir().join("nccl-plugin");
        std::fs::create_dir_all(&dir).expect("mkdir nccl-plugin");
        let tmp = dir.join(format!(".copy-{}", std::process::id()));
        std::fs::copy(&built, &tmp).expect("copy plugin");
        std::fs::rename(&tmp, dir.join("libnccl-net-ferroce.so")).expect("rename plugin");
        dir
    })
    .clone()
}

/// The plugin, opened by path (in-process tests cannot change `LD_LIBRARY_PATH`).
pub fn open_plugin() -> Library {
    let path = plugin_dir().join("libnccl-net-ferroce.so");
    Library::open(path.to_str().expect("utf-8 path")).expect("dlopen plugin")
}
