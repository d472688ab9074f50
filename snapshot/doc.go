// Package snapshot saves a paused Kiln VM to a directory and restores VMs
// from it. A snapshot is untrusted input: whoever can write the directory
// (or a guest that escaped into the VMM that saved it) may have crafted
// it, so nothing in it is used before it is authenticated, and nothing in
// it names a host file that a restore opens.
//
// A snapshot (format 3) is a directory of four files:
//
//	manifest.json  the format version, the VM's shape (vCPUs, memory,
//	               virtio devices), when it was made, and the size and
//	               SHA-256 of the state file and the digest of the memory
//	               file
//	manifest.mac   HMAC-SHA256 of the manifest under the host key
//	               (LoadKey: kilnd keeps one in its state folder, the kiln
//	               CLI under the user's config folder)
//	state.json     vmm.State as JSON: vCPUs, irqchip, PIT, clock, COM1,
//	               virtio transports and devices
//	memory         guest RAM, the regions one after another, written
//	               sparse: pages of zeros are holes
//
// Save writes the files into a temporary directory beside the target
// (dir + ".tmp-XXXX"), syncs them and the directory, and renames it into
// place, so a snapshot directory is either whole or absent; when anything
// fails (a full disk, say) the temporary directory is removed. It refuses
// to replace an existing snapshot unless asked (Overwrite). Without the
// key (a VMM process, which never holds it) it writes no MAC: the caller
// that holds the key signs the snapshot after (Sign).
//
// Load opens each file beneath the directory, never through a symbolic
// link (openat2 RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS), and only regular
// files. It authenticates the manifest (WithKey; or WithManifestDigest,
// the manifest a caller with the key checked: Verify) and checks the
// state file and the memory file against it, and the caller's config
// (vCPUs, memory, device types) against the state, before it builds
// anything; a mismatch is ErrAuth or ErrChecksum (whose messages never
// say what a digest should have been), ErrCorrupt or ErrMismatch. The
// disks a snapshot records are never opened: the caller names each one
// (vmm.RestoreConfig.Devices), and the state's capacity checks it.
//
// Where the memory file's file system has fs-verity (ext4 made or tuned
// with the verity feature, btrfs, f2fs), Save seals the file with it and
// the manifest records its fs-verity digest (package fsverity): from then
// on the file cannot be written, and the kernel checks every page read
// from it against that digest. A restore whose memory file measures so
// maps the file itself copy-on-write, with no copy and no hash first: it
// reads only what the guest touches, and a page that does not match fails
// its read (the VM stops: KVM_RUN's EFAULT, or the VMM process's SIGBUS),
// never reaching the guest. A memory file measured with another digest is
// ErrChecksum; one without fs-verity (the snapshot was copied off) takes
// the copy below. Sealing costs the save a read and a hash of the whole
// file, holes included (NoVerity skips it).
//
// Otherwise the memory file is copied, as its digest is checked, into a memfd that
// is then sealed against writes, shrinking and growing (memory.NewSealed),
// and the VM maps that copy-on-write: the memory a restored VM runs on is
// the memory that was checked, and a write to or a truncation of the file
// later changes nothing (no SIGBUS). A Cache keeps the copy for the next
// restores of the same file in the process (the clones of a template),
// which share its pages; a VMM process is handed the copy by the process
// that checked it (WithSealedMemory). The copy costs a read of the file's
// data (BenchmarkOpen: 75 ms for 64 MiB of data on the idle 2-core test
// machine, 200-290 ms loaded; a cached restore 1.5-3.5 ms) and that data in RAM (shmem) for
// as long as a VM maps it or the Cache keeps it.
package snapshot
