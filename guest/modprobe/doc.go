// Package modprobe is Kiln's modprobe: it loads a kernel module, named by
// its name or by one of its aliases, with the modules it depends on, from
// a depmod'd modules tree (the kernel's modules disk, mounted by the guest
// agent at /lib/modules/<release>). It exists for the kernel's module
// autoloading: request_module runs the usermode helper named in
// /proc/sys/kernel/modprobe as `modprobe -q -- NAME`, NAME often an alias
// (rtnl-link-veth, fs-overlay, nft-chain-2-nat), and a root without kmod
// (Debian's minbase, most slim images) has no /sbin/modprobe, so every
// such request failed there. The agent binary is a multi-call binary: run
// as modprobe (argv[0]'s base name, IsInvokedAs) it is this; guest/pid1
// makes it the kernel's helper (InstallModprobeHelper).
//
// What it does, as kmod's modprobe does: the name is normalised ('-' and
// '_' are one); a module already in the kernel (/sys/module/NAME) or built
// in (modules.builtin, and the aliases of modules.builtin.modinfo) is
// success; otherwise the name is looked up as a module of modules.dep,
// then as "symbol:..." in modules.symbols, then among the glob patterns of
// modules.alias (every match is loaded). Each module is loaded after its
// modules.softdep "pre:" modules (best effort) and its modules.dep
// dependencies (recursively), with finit_module(2); the kernel's EEXIST
// (loaded meanwhile) is success. A compressed module (.ko.gz, .ko.xz,
// .ko.zst) is handed to the kernel to decompress
// (MODULE_INIT_COMPRESSED_FILE, Linux 6.4 with CONFIG_MODULE_DECOMPRESS);
// where the kernel cannot, a gzip one is decompressed here and loaded with
// init_module(2), and an xz or zstd one fails, saying why. Debian's 6.1
// kernel, the one Kiln boots, has plain .ko files.
//
// What it does not: /etc/modprobe.d (options, blacklists, install and
// remove commands, aliases of its own) and removal (-r). The kernel only
// ever asks its helper to load.
//
// It reads a bounded number of files, each of bounded size (MaxIndexBytes,
// MaxModuleBytes), at most MaxModules modules per run, never follows a
// modules.dep path out of the tree (guestkernel.ParseModulesDep refuses
// absolute and ".." paths) and opens only regular files, so that a broken
// or hostile tree makes it fail, not hang.
package modprobe
