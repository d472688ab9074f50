package acpi

import (
	"bytes"
	"encoding/hex"
	"strings"
	"testing"
)

func TestPkgLength(t *testing.T) {
	// n is the length of what follows the PkgLength; the encoded value
	// also counts the PkgLength's own bytes.
	tests := []struct {
		n    int
		want string
	}{
		{0, "01"},
		{1, "02"},
		{62, "3f"},            // largest one-byte form: 63
		{63, "4104"},          // 65 = 0x041
		{4093, "4fff"},        // largest two-byte form: 0xFFF
		{4094, "810001"},      // 4096 does not fit two bytes, 4097 = 0x1001 takes three
		{1<<20 - 4, "8fffff"}, // largest three-byte form: 0xFFFFF
		{1<<20 - 3, "c1000001"},
		{1<<28 - 5, "cfffffff"}, // largest four-byte form
	}
	for _, tt := range tests {
		got, err := appendPkgLength(nil, tt.n)
		if err != nil {
			t.Errorf("appendPkgLength(%d): %v", tt.n, err)
			continue
		}
		if h := hex.EncodeToString(got); h != tt.want {
			t.Errorf("appendPkgLength(%d) = %s, want %s", tt.n, h, tt.want)
		}
	}
	if _, err := appendPkgLength(nil, 1<<28-4); err == nil {
		t.Errorf("appendPkgLength(%d) succeeded, want an error", 1<<28-4)
	}
}

// TestPkgLengthIASL checks buffers whose PkgLength sits at the one/two and
// two/three byte boundaries against what iasl 20200925 emits for
// Buffer() {0x00, 0x01, ...}.
func TestPkgLengthIASL(t *testing.T) {
	tests := []struct {
		size   int
		prefix string // BufferOp, PkgLength, BufferSize
	}{
		{59, "113e0a3b"},
		{60, "113f0a3c"},
		{61, "1141040a3d"},
		{4090, "114fff0bfa0f"},
		{4091, "118100010bfb0f"},
		{4092, "118200010bfc0f"},
	}
	for _, tt := range tests {
		data := make([]byte, tt.size)
		for i := range data {
			data[i] = byte(i)
		}
		got, err := Encode(Buffer(data))
		if err != nil {
			t.Fatalf("Buffer(%d bytes): %v", tt.size, err)
		}
		want, _ := hex.DecodeString(tt.prefix)
		if !bytes.HasPrefix(got, want) || !bytes.Equal(got[len(want):], data) {
			t.Errorf("Buffer(%d bytes) starts % x, want % x followed by the data", tt.size, got[:len(want)], want)
		}
	}
}

func TestFieldLength(t *testing.T) {
	// Unlike a PkgLength, a field length does not count its own bytes.
	tests := []struct {
		bits uint32
		want string
	}{
		{8, "08"},
		{0x3F, "3f"},
		{64, "4004"},
		{0xFFF, "4fff"},
		{4096, "800001"},
		{0xFFFFF, "8fffff"},
		{0x100000, "c0000001"},
		{1<<28 - 1, "cfffffff"},
	}
	for _, tt := range tests {
		got, err := appendFieldLength(nil, tt.bits)
		if err != nil {
			t.Errorf("appendFieldLength(%#x): %v", tt.bits, err)
			continue
		}
		if h := hex.EncodeToString(got); h != tt.want {
			t.Errorf("appendFieldLength(%#x) = %s, want %s", tt.bits, h, tt.want)
		}
	}
	if _, err := appendFieldLength(nil, 1<<28); err == nil {
		t.Error("appendFieldLength(1<<28) succeeded, want an error")
	}
}

func TestEISAID(t *testing.T) {
	tests := []struct {
		id   EISAID
		want uint32
	}{
		{"PNP0501", 0x0105D041},
		{"PNP0C0C", 0x0C0CD041},
		{"PNP0A03", 0x030AD041},
		{"PNP0B00", 0x000BD041},
		{"QEM0001", 0x0100AD44}, // Q=17 E=5 M=13: 10001 00101 01101 = 0x44AD
	}
	for _, tt := range tests {
		got, err := tt.id.Value()
		if err != nil {
			t.Errorf("EISAID(%q): %v", tt.id, err)
			continue
		}
		if got != tt.want {
			t.Errorf("EISAID(%q) = %#08x, want %#08x", tt.id, got, tt.want)
		}
	}
}

// TestEncodeIASL compares the encoder with what iasl 20200925 compiles from
// the ASL in each case's comment (the AML after the table header).
func TestEncodeIASL(t *testing.T) {
	tests := []struct {
		name  string
		terms []Term
		want  string
	}{
		{
			// Device (COM1) { Name (_HID, EisaId ("PNP0501")) Name (_UID, One)
			//   Name (_CRS, ResourceTemplate () { IO (Decode16, 0x03F8, 0x03F8, 0x01, 0x08) IRQNoFlags () {4} }) }
			name: "serial",
			terms: []Term{Device("COM1",
				Name("_HID", EISAID("PNP0501")),
				Name("_UID", Integer(1)),
				Name("_CRS", ResourceTemplate(
					IO{Min: 0x3F8, Max: 0x3F8, Align: 1, Length: 8},
					IRQNoFlags{IRQs: []uint8{4}},
				)),
			)},
			want: "5b822b434f4d31085f4849440c41d00501085f55494401085f43525311100a0d4701f803f80301082210007900",
		},
		{
			// Device (VR00) { Name (_HID, "LNRO0005") Name (_UID, Zero) Name (_CCA, One)
			//   Name (_CRS, ResourceTemplate () { Memory32Fixed (ReadWrite, 0xD0000000, 0x00000200)
			//     Interrupt (ResourceConsumer, Level, ActiveHigh, Exclusive) {5} }) }
			name: "virtio",
			terms: []Term{Device("VR00",
				Name("_HID", String("LNRO0005")),
				Name("_UID", Integer(0)),
				Name("_CCA", Integer(1)),
				Name("_CRS", ResourceTemplate(
					Memory32Fixed{Writable: true, Base: 0xD0000000, Length: 0x200},
					ExtendedInterrupt{Consumer: true, GSIs: []uint32{5}},
				)),
			)},
			want: "5b82410456523030085f4849440d4c4e524f3030303500085f55494400085f43434101085f435253111a0a1786090001000000d0000200008906000101050000007900",
		},
		{
			// Name (_S5, Package (0x04) { 0x05, Zero, Zero, Zero })
			name:  "s5",
			terms: []Term{Name("_S5", Package(Integer(5), Integer(0), Integer(0), Integer(0)))},
			want:  "085f53355f1207040a05000000",
		},
		{
			// Device (GED) { Name (_HID, "ACPI0013")
			//   OperationRegion (EREG, SystemMemory, 0xD0001000, 0x04)
			//   Field (EREG, DWordAcc, NoLock, WriteAsZeros) { ESEL, 32 }
			//   Method (_EVT, 1, Serialized) { Local0 = ESEL
			//     If (((Local0 & One) == One)) { Notify (PWRB, 0x80) } } }
			// Device (PWRB) { Name (_HID, EisaId ("PNP0C0C")) }
			name: "ged",
			terms: []Term{
				Device("GED",
					Name("_HID", String("ACPI0013")),
					OperationRegion("EREG", SystemMemory, Integer(0xD0001000), Integer(4)),
					Field("EREG", DWordAcc, false, WriteAsZeros, FieldUnit{"ESEL", 32}),
					Method("_EVT", 1, true,
						Store(Path("ESEL"), Local(0)),
						If(LEqual(And(Local(0), Integer(1), nil), Integer(1)),
							Notify(Path("PWRB"), Integer(0x80)))),
				),
				Device("PWRB", Name("_HID", EISAID("PNP0C0C"))),
			},
			want: "5b824c044745445f085f4849440d4143504930303133005b8045524547000c001000d00a045b810b45524547434553454c20141b5f45565409704553454c60a00e937b6001000186505752420a805b820f50575242085f4849440c41d00c0c",
		},
		{
			// Name (INTS, Package () { Zero, One, 0x02, 0xFF, 0x0100, 0xFFFF, 0x00010000,
			//   0xFFFFFFFF, 0x0000000100000000, 0xFFFFFFFFFFFFFFFE, Ones, "Kiln" })
			name: "integers",
			terms: []Term{Name("INTS", Package(
				Integer(0), Integer(1), Integer(2), Integer(0xFF), Integer(0x100), Integer(0xFFFF),
				Integer(0x10000), Integer(0xFFFFFFFF), Integer(1<<32), Integer(0xFFFFFFFFFFFFFFFE),
				OnesOp{}, String("Kiln"),
			))},
			want: "08494e545312310c00010a020aff0b00010bffff0c000001000cffffffff0e00000000010000000efeffffffffffffffff0d4b696c6e00",
		},
		{
			// Scope (\_SB) { Device (PCI0) { Device (S00) { Name (_ADR, Zero) } } }
			// Name (\_SB.PCI0.S00.ABC, One) Name (\_SB.X, One) Scope (\_SB.PCI0) { Name (^Y, One) }
			name: "paths",
			terms: []Term{
				Scope(`\_SB`, Device("PCI0", Device("S00", Name("_ADR", Integer(0))))),
				Name(`\_SB.PCI0.S00.ABC`, Integer(1)),
				Name(`\_SB.X`, Integer(1)),
				Scope(`\_SB.PCI0`, Name("^Y", Integer(1))),
			},
			want: "101a5c5f53425f5b8212504349305b820b5330305f085f41445200085c2f045f53425f504349305330305f4142435f01085c2e5f53425f585f5f5f0110125c2e5f53425f50434930085e595f5f5f01",
		},
		{
			// Method (M, 7, NotSerialized) { Local7 = Arg6
			//   If (LOr (!Arg0, Arg1)) { Return (Or (Arg2, 0x10, Local1)) }
			//   Else { Return (LAnd (Arg0, Local7)) } }
			// Method (N, 0, NotSerialized) { Return (M (One, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07)) }
			name: "methods",
			terms: []Term{
				Method("M", 7, false,
					Store(Arg(6), Local(7)),
					If(LOr(LNot(Arg(0)), Arg(1)),
						Return(Or(Arg(2), Integer(0x10), Local(1)))),
					Else(Return(LAnd(Arg(0), Local(7)))),
				),
				Method("N", 0, false,
					Return(Call("M", Integer(1), Integer(2), Integer(3), Integer(4), Integer(5), Integer(6), Integer(7)))),
			},
			want: "141b4d5f5f5f07706e67a00b91926869a47d6a0a1061a105a490686714184e5f5f5f00a44d5f5f5f010a020a030a040a050a060a07",
		},
		{
			// OperationRegion (R0, SystemIO, 0x10, 0x0400)
			// Field (R0, ByteAcc, Lock, Preserve) { A, 8, , 56, B, 64, C, 4096 }
			name: "field",
			terms: []Term{
				OperationRegion("R0", SystemIO, Integer(0x10), Integer(0x400)),
				Field("R0", ByteAcc, true, Preserve,
					FieldUnit{"A", 8}, FieldUnit{"", 56}, FieldUnit{"B", 64}, FieldUnit{"C", 4096}),
			},
			want: "5b8052305f5f010a100b00045b811a52305f5f11415f5f5f080038425f5f5f4004435f5f5f800001",
		},
		{
			// Name (RES, ResourceTemplate () { Memory32Fixed (ReadOnly, 0x12345678, 0x1000)
			//   Interrupt (ResourceConsumer, Edge, ActiveLow, Shared) {5, 0x20}
			//   IO (Decode16, 0x60, 0x64, 0x04, 0x01) IRQNoFlags () {1, 12} })
			name: "resources",
			terms: []Term{Name("RES", ResourceTemplate(
				Memory32Fixed{Base: 0x12345678, Length: 0x1000},
				ExtendedInterrupt{Consumer: true, Edge: true, ActiveLow: true, Shared: true, GSIs: []uint32{5, 0x20}},
				IO{Min: 0x60, Max: 0x64, Align: 4, Length: 1},
				IRQNoFlags{IRQs: []uint8{1, 12}},
			))},
			want: "085245535f11290a26860900007856341200100000890a000f02050000002000000047016000640004012202107900",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Encode(tt.terms...)
			if err != nil {
				t.Fatalf("Encode: %v", err)
			}
			if h := hex.EncodeToString(got); h != tt.want {
				t.Errorf("Encode =\n%s\nwant\n%s", h, tt.want)
			}
		})
	}
}

func TestEncodeErrors(t *testing.T) {
	many := make([]Term, 256)
	for i := range many {
		many[i] = Integer(i)
	}
	tests := []struct {
		name string
		term Term
		want string // part of the error
	}{
		{"name too long", Name("ABCDE", Integer(0)), `"ABCDE"`},
		{"name starts with digit", Name("1ABC", Integer(0)), `"1ABC"`},
		{"lower-case name", Device("com1"), `"com1"`},
		{"empty path segment", Name(`\_SB..X`, Integer(0)), `\_SB..X`},
		{"bare root prefix", Name(`^`, Integer(0)), `"^"`},
		{"empty name", Scope(""), "empty name"},
		{"nil value", Name("X", nil), "nil value"},
		{"nil term in body", Device("D", nil), "term 0 is nil"},
		{"Local8", Store(Integer(0), Local(8)), "Local8"},
		{"Arg7", Return(Arg(7)), "Arg7"},
		{"too many method args", Method("M", 8, false), "8 arguments"},
		{"package of 256", Package(many...), "256 elements"},
		{"string with NUL", String("a\x00b"), "not ASCII"},
		{"string with UTF-8", String("é"), "not ASCII"},
		{"EISA ID length", EISAID("PNP050"), "7 characters"},
		{"EISA ID letters", EISAID("pnp0501"), "A-Z"},
		{"EISA ID hex", EISAID("PNP05G1"), "hex digit"},
		{"IRQ above 15", ResourceTemplate(IRQNoFlags{IRQs: []uint8{16}}), "IRQ 16"},
		{"no interrupts", ResourceTemplate(ExtendedInterrupt{}), "0 interrupts"},
		{"memory past 4 GiB", ResourceTemplate(Memory32Fixed{Base: 0xFFFFF000, Length: 0x2000}), "4 GiB"},
		{"IO min above max", ResourceTemplate(IO{Min: 2, Max: 1}), "above maximum"},
		{"IO past 0xFFFF", ResourceTemplate(IO{Min: 0xFFFC, Max: 0xFFFC, Length: 8}), "0xFFFF"},
		{"nil descriptor", ResourceTemplate(nil), "descriptor 0 is nil"},
		{"field access", Field("R", 7, false, Preserve), "access type"},
		{"field update", Field("R", AnyAcc, false, 3), "update rule"},
		{"field unit name", Field("R", AnyAcc, false, Preserve, FieldUnit{"TOOLONG", 8}), "TOOLONG"},
		{"nested error", Scope(`\_SB`, Device("OK", Method("bad", 0, false))), `"bad"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Encode(tt.term)
			if err == nil {
				t.Fatalf("Encode succeeded with % x, want an error containing %q", got, tt.want)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Encode error %q does not contain %q", err, tt.want)
			}
		})
	}
}
