package acpi

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// These tests check the tables with ACPICA, the ACPI implementation inside
// Linux: iasl disassembles them and compiles the DSDT back, acpiexec loads
// them into an ACPI namespace and runs their methods.

// requireTool returns the path of an acpica-tools program.
func requireTool(t *testing.T, name string) string {
	t.Helper()
	path, err := exec.LookPath(name)
	if err != nil {
		t.Fatalf("%s not found (%v): `make deps` installs acpica-tools", name, err)
	}
	return path
}

// runTool runs a program in dir and returns its combined output.
func runTool(t *testing.T, dir, prog string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, prog, args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", filepath.Base(prog), strings.Join(args, " "), err, out)
	}
	return string(out)
}

// squeeze collapses runs of white space, so that expectations need not
// copy iasl's column alignment.
func squeeze(s string) string { return strings.Join(strings.Fields(s), " ") }

// complaint matches what ACPICA prints about a broken table.
var complaint = regexp.MustCompile(`(?i)warning|error|exception|incorrect|invalid|unknown|too (short|long)`)

func TestIASLDisassemble(t *testing.T) {
	iasl := requireTool(t, "iasl")
	tests := []struct {
		name string
		cfg  Config
	}{
		{"1 CPU, serial only", baseConfig(1)},
		{"2 CPUs, all devices", fullConfig(2)},
		{"8 CPUs, GED without VMGenID", func() Config { c := fullConfig(8); c.VMGenID = nil; return c }()},
		{"serial on GSI 20, VMGenID above 4 GiB", func() Config {
			c := fullConfig(3)
			c.Serial[1].IRQ = 20
			c.VMGenID.Addr = 0xFF_FFFF_F000
			return c
		}()},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			img, err := Build(tt.cfg)
			if err != nil {
				t.Fatal(err)
			}
			ts := parseImage(t, img)
			dir := t.TempDir()
			files := []struct {
				name  string
				table []byte
				want  []string
			}{
				{"xsdt", ts.xsdt, []string{
					fmt.Sprintf("ACPI Table Address 0 : %016X", img.Base+uint64(bytes.Index(img.Bytes, ts.fadt))),
					fmt.Sprintf("ACPI Table Address 1 : %016X", img.Base+uint64(bytes.Index(img.Bytes, ts.madt))),
				}},
				{"facp", ts.fadt, []string{
					"Revision : 06",
					"Hardware Reduced (V5) : 1",
					"Reset Register Supported (V2) : 1",
					"VGA Not Present (V4) : 1",
					"8042 Present on ports 60/64 (V2) : 0",
					"SCI Interrupt : 0000",
					fmt.Sprintf("Reset Register : [Generic Address Structure] [074h 0116 1] Space ID : 00 [SystemMemory] [075h 0117 1] Bit Width : 08 [076h 0118 1] Bit Offset : 00 [077h 0119 1] Encoded Access Width : 01 [Byte Access:8] [078h 0120 8] Address : %016X", tt.cfg.ResetReg),
					fmt.Sprintf("Value to cause reset : %02X", tt.cfg.ResetValue),
					"FADT Minor Revision : 05",
					fmt.Sprintf("DSDT Address : %016X", img.Base+uint64(bytes.Index(img.Bytes, ts.dsdt))),
					fmt.Sprintf("Sleep Control Register : [Generic Address Structure] [0F4h 0244 1] Space ID : 00 [SystemMemory] [0F5h 0245 1] Bit Width : 08 [0F6h 0246 1] Bit Offset : 00 [0F7h 0247 1] Encoded Access Width : 01 [Byte Access:8] [0F8h 0248 8] Address : %016X", tt.cfg.SleepControl),
					fmt.Sprintf("Sleep Status Register : [Generic Address Structure] [100h 0256 1] Space ID : 00 [SystemMemory] [101h 0257 1] Bit Width : 08 [102h 0258 1] Bit Offset : 00 [103h 0259 1] Encoded Access Width : 01 [Byte Access:8] [104h 0260 8] Address : %016X", tt.cfg.SleepStatus),
				}},
				{"apic", ts.madt, []string{
					"Local Apic Address : FEE00000",
					"PC-AT Compatibility : 1",
					"Subtable Type : 01 [I/O APIC]",
					"I/O Apic ID : 00",
					"Address : FEC00000",
					"Subtable Type : 04 [Local APIC NMI]",
					"Processor ID : FF",
					"Interrupt Input LINT : 01",
					fmt.Sprintf("Processor ID : %02X [%03Xh %04d 1] Local Apic ID : %02X", tt.cfg.CPUs-1, 44+8*tt.cfg.CPUs-5, 44+8*tt.cfg.CPUs-5, tt.cfg.CPUs-1),
				}},
				{"dsdt", ts.dsdt, dsdtASL(tt.cfg)},
			}
			for _, f := range files {
				if err := os.WriteFile(filepath.Join(dir, f.name+".dat"), f.table, 0o644); err != nil {
					t.Fatal(err)
				}
				out := runTool(t, dir, iasl, "-d", f.name+".dat")
				if m := complaint.FindString(out); m != "" {
					t.Errorf("iasl -d %s.dat complains (%q):\n%s", f.name, m, out)
				}
				dsl, err := os.ReadFile(filepath.Join(dir, f.name+".dsl"))
				if err != nil {
					t.Fatalf("iasl wrote no disassembly: %v\n%s", err, out)
				}
				if m := complaint.FindString(string(dsl)); m != "" {
					t.Errorf("%s.dsl has %q:\n%s", f.name, m, dsl)
				}
				text := squeeze(string(dsl))
				for _, w := range f.want {
					if !strings.Contains(text, squeeze(w)) {
						t.Errorf("%s.dsl lacks %q:\n%s", f.name, w, dsl)
					}
				}
				if f.name == "apic" {
					if n := strings.Count(text, "Subtable Type : 00 [Processor Local APIC]"); n != tt.cfg.CPUs {
						t.Errorf("apic.dsl has %d local APICs, want %d", n, tt.cfg.CPUs)
					}
					if n := strings.Count(text, "Processor Enabled : 1"); n != tt.cfg.CPUs {
						t.Errorf("apic.dsl has %d enabled processors, want %d", n, tt.cfg.CPUs)
					}
				}
			}

			// Compile the disassembled DSDT again: iasl must accept
			// it without a warning and produce the same AML.
			out := runTool(t, dir, iasl, "-p", "recompiled", "dsdt.dsl")
			if !strings.Contains(out, "0 Errors, 0 Warnings") {
				t.Errorf("iasl dsdt.dsl:\n%s", out)
			}
			aml, err := os.ReadFile(filepath.Join(dir, "recompiled.aml"))
			if err != nil {
				t.Fatal(err)
			}
			if len(aml) < headerSize || !bytes.Equal(aml[headerSize:], ts.dsdt[headerSize:]) {
				t.Errorf("iasl compiles the disassembled DSDT to different AML:\n got % x\nwant % x", aml, ts.dsdt)
			}
		})
	}
}

// dsdtASL lists ASL the disassembly of cfg's DSDT must contain.
func dsdtASL(cfg Config) []string {
	want := []string{
		"Scope (_SB)",
		"Name (_S5, Package (0x04) // _S5_: S5 System State { 0x05, Zero, Zero, Zero })",
	}
	for i, s := range cfg.Serial {
		irq := fmt.Sprintf("IRQNoFlags () {%d}", s.IRQ)
		if s.IRQ > 15 {
			irq = fmt.Sprintf("Interrupt (ResourceConsumer, Edge, ActiveHigh, Exclusive, ,, ) { 0x%08X, }", s.IRQ)
		}
		want = append(want, fmt.Sprintf(`Device (COM%d) { Name (_HID, EisaId ("PNP0501") /* 16550A-compatible COM Serial Port */) // _HID: Hardware ID
			Name (_UID, %s) // _UID: Unique ID
			Name (_CRS, ResourceTemplate () // _CRS: Current Resource Settings
			{ IO (Decode16, 0x%04X, // Range Minimum
			0x%04X, // Range Maximum
			0x01, // Alignment
			0x08, // Length
			) %s }) }`, i+1, aslInt(uint64(i+1)), s.Port, s.Port, irq))
	}
	for i, d := range cfg.VirtioMMIO {
		want = append(want, fmt.Sprintf(`Device (VR%02X) { Name (_HID, "LNRO0005") // _HID: Hardware ID
			Name (_UID, %s) // _UID: Unique ID
			Name (_CCA, One) // _CCA: Cache Coherency Attribute
			Name (_CRS, ResourceTemplate () // _CRS: Current Resource Settings
			{ Memory32Fixed (ReadWrite, 0x%08X, // Address Base
			0x%08X, // Address Length
			) Interrupt (ResourceConsumer, Level, ActiveHigh, Exclusive, ,, ) { 0x%08X, } }) }`,
			i, aslInt(uint64(i)), d.Base, d.Size, d.GSI))
	}
	if g := cfg.GED; g != nil {
		want = append(want,
			`Device (GED) { Name (_HID, "ACPI0013" /* Generic Event Device */) // _HID: Hardware ID`,
			fmt.Sprintf(`Interrupt (ResourceConsumer, Edge, ActiveHigh, Exclusive, ,, ) { 0x%08X, }`, g.GSI),
			fmt.Sprintf(`OperationRegion (EREG, SystemMemory, 0x%08X, 0x04)`, g.Base),
			`Field (EREG, DWordAcc, NoLock, WriteAsZeros) { ESEL, 32 }`,
			`Method (_EVT, 1, Serialized) // _EVT: Event { Local0 = ESEL /* \_SB_.GED_.ESEL */ If (((Local0 & One) == One)) { Notify (PWRB, 0x80) // Status Change }`,
			`Device (PWRB) { Name (_HID, EisaId ("PNP0C0C") /* Power Button Device */) // _HID: Hardware ID`,
		)
		if cfg.VMGenID != nil {
			want = append(want, `If (((Local0 & 0x02) == 0x02)) { Notify (VGEN, 0x80) // Status Change }`)
		}
	}
	if v := cfg.VMGenID; v != nil {
		want = append(want,
			`Device (VGEN) { Name (_HID, "KILN0001") // _HID: Hardware ID
			Name (_CID, Package (0x02) // _CID: Compatible ID { "VM_Gen_Counter", "VMGENCTR" })
			Name (_DDN, "VM_Gen_Counter") // _DDN: DOS Device Name`,
			fmt.Sprintf(`Method (ADDR, 0, NotSerialized) { Return (Package (0x02) { %s, %s }) }`,
				aslInt(v.Addr&0xFFFFFFFF), aslInt(v.Addr>>32)),
		)
	}
	return want
}

// aslInt formats v as iasl's disassembler does.
func aslInt(v uint64) string {
	switch {
	case v == 0:
		return "Zero"
	case v == 1:
		return "One"
	case v <= 0xFF:
		return fmt.Sprintf("0x%02X", v)
	case v <= 0xFFFF:
		return fmt.Sprintf("0x%04X", v)
	case v <= 0xFFFFFFFF:
		return fmt.Sprintf("0x%08X", v)
	}
	return fmt.Sprintf("0x%016X", v)
}

// TestACPIExec loads the tables into ACPICA's namespace with acpiexec and
// evaluates what Linux evaluates: the devices' IDs and resources, the
// VM Generation ID address, \_S5, and the GED's _EVT, driven by a test
// SSDT that stores an event selector value and calls _EVT.
func TestACPIExec(t *testing.T) {
	acpiexec := requireTool(t, "acpiexec")
	cfg := fullConfig(2)
	img, err := Build(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ts := parseImage(t, img)

	// Method (TEVT, 1) { \_SB.GED.ESEL = Arg0; \_SB.GED._EVT (GSI) }
	aml, err := Encode(Method("TEVT", 1, false,
		Store(Arg(0), Path(`\_SB.GED.ESEL`)),
		Call(`\_SB.GED._EVT`, Integer(cfg.GED.GSI))))
	if err != nil {
		t.Fatal(err)
	}
	ssdt := make([]byte, headerSize+len(aml))
	writeHeader(ssdt, "SSDT", dsdtRevision)
	copy(ssdt[headerSize:], aml)
	setChecksum(ssdt, 9)

	dir := t.TempDir()
	for name, tb := range map[string][]byte{"dsdt": ts.dsdt, "facp": ts.fadt, "apic": ts.madt, "ssdt": ssdt} {
		if err := os.WriteFile(filepath.Join(dir, name+".dat"), tb, 0o644); err != nil {
			t.Fatal(err)
		}
	}

	// Each evaluation, with what its output must contain and, for the
	// events, which notifications it must (not) cause.
	type eval struct {
		cmd    string
		want   []string
		deny   []string
		notify []string // devices that must be notified with 0x80
	}
	var evals []eval
	for i, s := range cfg.Serial {
		dev := fmt.Sprintf(`\_SB.COM%d`, i+1)
		evals = append(evals,
			eval{cmd: dev + "._HID", want: []string{"[Integer] = 000000000105D041"}},
			eval{cmd: dev + "._UID", want: []string{fmt.Sprintf("[Integer] = %016X", i+1)}},
			eval{cmd: dev + "._CRS", want: []string{fmt.Sprintf("47 01 %02X %02X %02X %02X 01 08 22 %02X %02X 79 00",
				s.Port&0xFF, s.Port>>8, s.Port&0xFF, s.Port>>8, (1<<s.IRQ)&0xFF, (1<<s.IRQ)>>8)}})
	}
	for i, d := range cfg.VirtioMMIO {
		dev := fmt.Sprintf(`\_SB.VR%02X`, i)
		evals = append(evals,
			eval{cmd: dev + "._HID", want: []string{`"LNRO0005"`}},
			eval{cmd: dev + "._UID", want: []string{fmt.Sprintf("[Integer] = %016X", i)}},
			eval{cmd: dev + "._CCA", want: []string{"[Integer] = 0000000000000001"}},
			eval{cmd: dev + "._CRS", want: []string{fmt.Sprintf("86 09 00 01 %02X %02X %02X %02X", d.Base&0xFF, d.Base>>8&0xFF, d.Base>>16&0xFF, d.Base>>24)}})
	}
	evals = append(evals,
		eval{cmd: `\_SB.GED._HID`, want: []string{`"ACPI0013"`}},
		eval{cmd: `\_SB.GED._CRS`, want: []string{fmt.Sprintf("89 06 00 03 01 %02X 00 00 00 79 00", cfg.GED.GSI)}},
		eval{cmd: `\_SB.PWRB._HID`, want: []string{"[Integer] = 000000000C0CD041"}},
		eval{cmd: `\_SB.VGEN._HID`, want: []string{`"KILN0001"`}},
		// ACPICA upper-cases _CID strings: Linux sees VM_GEN_COUNTER,
		// the ID its vmgenid driver matches.
		eval{cmd: `\_SB.VGEN._CID`, want: []string{`"VM_GEN_COUNTER"`, `"VMGENCTR"`}},
		eval{cmd: `\_SB.VGEN.ADDR`, want: []string{
			fmt.Sprintf("[Integer] = %016X", cfg.VMGenID.Addr&0xFFFFFFFF),
			fmt.Sprintf("[Integer] = %016X", cfg.VMGenID.Addr>>32)}},
		eval{cmd: `\_S5`, want: []string{"Contains 4 Elements", "[Integer] = 0000000000000005"}},
		eval{cmd: `\TEVT 0`, deny: []string{"Notify"}},
		eval{cmd: `\TEVT 1`, notify: []string{"PWRB"}, deny: []string{"[VGEN]"}},
		eval{cmd: `\TEVT 2`, notify: []string{"VGEN"}, deny: []string{"[PWRB]"}},
		eval{cmd: `\TEVT 3`, notify: []string{"PWRB", "VGEN"}},
	)
	cmds := make([]string, len(evals))
	for i, e := range evals {
		cmds[i] = "evaluate " + e.cmd
	}
	out := runTool(t, dir, acpiexec, "-b", strings.Join(cmds, "; "), "dsdt.dat", "ssdt.dat", "facp.dat", "apic.dat")

	// acpiexec's allocation tracker reports leaks of its own (from the
	// _HID/_CID repairs) as "Outstanding ... allocations"; anything
	// else ACPICA complains about is a fault in the tables.
	for _, line := range strings.Split(out, "\n") {
		if complaint.MatchString(line) && !strings.Contains(line, "Outstanding") {
			t.Errorf("acpiexec: %s", line)
		}
	}
	parts := strings.Split(out, "Evaluating ")
	if len(parts) != len(evals)+1 {
		t.Fatalf("acpiexec ran %d evaluations, want %d:\n%s", len(parts)-1, len(evals), out)
	}
	for i, e := range evals {
		part := squeeze(parts[i+1])
		name, _, _ := strings.Cut(e.cmd, " ")
		if !strings.HasPrefix(part, name) {
			t.Errorf("evaluation %d is %.40q, want %s", i, part, name)
		}
		if strings.Contains(part, "could not") || strings.Contains(part, "AE_") {
			t.Errorf("evaluate %s failed: %s", e.cmd, part)
		}
		for _, w := range e.want {
			if !strings.Contains(part, w) {
				t.Errorf("evaluate %s: output lacks %q:\n%s", e.cmd, w, parts[i+1])
			}
		}
		for _, n := range e.notify {
			re := regexp.MustCompile(`Notify on \[` + n + `\] \S+ Value 0x80\b`)
			if !re.MatchString(part) {
				t.Errorf("evaluate %s: no Notify(%s, 0x80):\n%s", e.cmd, n, parts[i+1])
			}
		}
		for _, d := range e.deny {
			if strings.Contains(part, d) {
				t.Errorf("evaluate %s: output has %q:\n%s", e.cmd, d, parts[i+1])
			}
		}
	}
}
