//! The network lock of a dump that kills: it holds the connections still
//! (its nft table exists) until the restore removes it.

use crate::options::RestoreOptions;

#[test]
fn lock_is_kept_by_a_kill_dump_and_removed_by_the_restore() {
    let dir = std::env::temp_dir().join(format!("cr-engine-netlock-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let ready = dir.join("ready");
    let prog = format!(
        "import os, socket, time\nos.closerange(3, 65536)\nl = socket.socket(); l.bind(('127.0.0.1', 0)); l.listen()\nc = socket.create_connection(l.getsockname()); s, _ = l.accept()\nopen({:?}, 'w').close()\ntime.sleep(600)\n",
        ready.display().to_string()
    );
    let child = std::process::Command::new("python3")
        .args(["-c", &prog])
        .stdin(std::process::Stdio::null())
        .spawn()
        .expect("python3");
    let pid = child.id() as i32;
    let t0 = std::time::Instant::now();
    while !ready.exists() {
        assert!(t0.elapsed().as_secs() < 30, "the program never got ready");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let img = dir.join("img");
    crate::kinds::testkit::checkpoint_kill(pid, &img).expect("checkpoint --kill");
    drop(child);
    let ck = cr_image::ImageDir::open(&img)
        .unwrap()
        .read_checkpoint()
        .unwrap();
    let lock = ck.netlock.clone().expect("the image names its lock");
    let tables = || {
        String::from_utf8_lossy(
            &std::process::Command::new("nft")
                .args(["list", "tables"])
                .output()
                .expect("nft")
                .stdout,
        )
        .into_owned()
    };
    assert!(
        tables().contains(&lock),
        "lock {lock} missing: {}",
        tables()
    );
    let restored = crate::restore(&img, &RestoreOptions::default()).expect("restore");
    assert!(
        !tables().contains(&lock),
        "lock {lock} still there after the restore"
    );
    let _ = cr_sys::ptrace::kill(restored, libc::SIGKILL);
    let _ = cr_sys::ptrace::wait_raw(restored, 0);
    let _ = std::fs::remove_dir_all(&dir);
}
