// Package snapshot saves a paused Kiln VM to a directory and restores VMs
// from it.
//
// A snapshot is a directory of three files:
//
//	manifest.json  the format version, the VM's shape (vCPUs, memory,
//	               virtio devices), when it was made, and the size and
//	               SHA-256 of the state file
//	state.json     vmm.State as JSON: vCPUs, irqchip, PIT, clock, COM1,
//	               virtio transports and devices
//	memory         guest RAM, the regions one after another, written
//	               sparse: pages of zeros are holes
//
// Save writes the files into a temporary directory beside the target
// (dir + ".tmp-XXXX"), syncs them and the directory, and renames it into
// place, so a snapshot directory is either whole or absent; when anything
// fails (a full disk, say) the temporary directory is removed. It refuses
// to replace an existing snapshot unless asked (Overwrite).
//
// Load checks the manifest (its format version), the state file (its size
// and checksum), the memory file (its size) and the caller's config (vCPUs,
// memory, device types) before it builds anything, and says what differs.
// It maps the memory file MAP_PRIVATE: pages are read lazily through the
// page cache and copied on a guest's first write, so any number of VMs
// restored from one snapshot share the pages none of them wrote, and the
// file never changes. The mapping lives as long as the VM (vmm.VM.Close
// unmaps it).
package snapshot
