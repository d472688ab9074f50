package acpi

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"strings"
)

// This file is a small encoder for ACPI Machine Language (AML), the byte
// code of the DSDT (ACPI 6.5, chapter 20). Each builder returns a Term; a
// Term appends its encoding to a byte slice and reports bad input (a name
// that is not a valid NameSeg, a package of more than 255 elements, ...) as
// an error instead of panicking. Encode joins a list of terms.
//
// The builders emit what iasl emits for the same ASL: integers take the
// shortest encoding, names are padded with '_' to four characters, and
// resource templates end with an EndTag whose checksum is 0.

// Term is an AML object, statement or expression.
type Term interface {
	// AppendAML appends the term's AML encoding to dst.
	AppendAML(dst []byte) ([]byte, error)
}

// Encode returns the AML encoding of terms, one after the other.
func Encode(terms ...Term) ([]byte, error) {
	return appendTerms(nil, terms)
}

func appendTerms(dst []byte, terms []Term) ([]byte, error) {
	for i, t := range terms {
		if t == nil {
			return nil, fmt.Errorf("aml: term %d is nil", i)
		}
		var err error
		if dst, err = t.AppendAML(dst); err != nil {
			return nil, err
		}
	}
	return dst, nil
}

// AML opcodes (ACPI 6.5, section 20.3).
const (
	opZero        = 0x00
	opOne         = 0x01
	opName        = 0x08
	opBytePrefix  = 0x0A
	opWordPrefix  = 0x0B
	opDWordPrefix = 0x0C
	opStrPrefix   = 0x0D
	opQWordPrefix = 0x0E
	opScope       = 0x10
	opBuffer      = 0x11
	opPackage     = 0x12
	opMethod      = 0x14
	opDualName    = 0x2E
	opMultiName   = 0x2F
	opExtPrefix   = 0x5B
	opRoot        = 0x5C
	opParent      = 0x5E
	opLocal0      = 0x60
	opArg0        = 0x68
	opStore       = 0x70
	opAnd         = 0x7B
	opOr          = 0x7D
	opNotify      = 0x86
	opLAnd        = 0x90
	opLOr         = 0x91
	opLNot        = 0x92
	opLEqual      = 0x93
	opIf          = 0xA0
	opElse        = 0xA1
	opReturn      = 0xA4
	opOnes        = 0xFF

	extOpRegion = 0x80 // after opExtPrefix
	extField    = 0x81
	extDevice   = 0x82
)

// maxPkgLength is the largest value a PkgLength can encode (28 bits).
const maxPkgLength = 1<<28 - 1

// appendPkgLength appends the PkgLength of a package whose contents after
// the PkgLength are n bytes long. The encoded value counts the PkgLength
// bytes themselves (ACPI 6.5, section 20.2.4).
func appendPkgLength(dst []byte, n int) ([]byte, error) {
	for size := 1; size <= 4; size++ {
		total := n + size
		if size == 1 && total <= 0x3F {
			return append(dst, byte(total)), nil
		}
		if size > 1 && total < 1<<(4+8*(size-1)) {
			return appendRawLength(dst, total, size), nil
		}
	}
	return nil, fmt.Errorf("aml: package of %d bytes exceeds the PkgLength limit of %d", n, maxPkgLength)
}

// appendFieldLength appends the bit length of a field unit. It is written
// in the PkgLength format but counts bits, not its own bytes.
func appendFieldLength(dst []byte, bits uint32) ([]byte, error) {
	switch {
	case bits <= 0x3F:
		return append(dst, byte(bits)), nil
	case bits < 1<<12:
		return appendRawLength(dst, int(bits), 2), nil
	case bits < 1<<20:
		return appendRawLength(dst, int(bits), 3), nil
	case bits <= maxPkgLength:
		return appendRawLength(dst, int(bits), 4), nil
	}
	return nil, fmt.Errorf("aml: field length of %d bits exceeds the limit of %d", bits, maxPkgLength)
}

// appendRawLength writes v in the multi-byte PkgLength format: the lead
// byte holds the count of following bytes in bits 7-6 and the low nibble
// of v in bits 3-0; the following bytes hold the rest, least significant
// first.
func appendRawLength(dst []byte, v, size int) []byte {
	dst = append(dst, byte((size-1)<<6)|byte(v&0x0F))
	v >>= 4
	for i := 1; i < size; i++ {
		dst = append(dst, byte(v))
		v >>= 8
	}
	return dst
}

// appendPackage appends op, the PkgLength of body, and body.
func appendPackage(dst []byte, op []byte, body []byte) ([]byte, error) {
	dst = append(dst, op...)
	dst, err := appendPkgLength(dst, len(body))
	if err != nil {
		return nil, err
	}
	return append(dst, body...), nil
}

// appendNameSeg appends a four-character NameSeg, padding a shorter name
// with '_'. A NameSeg starts with 'A'-'Z' or '_' and continues with those
// or '0'-'9'.
func appendNameSeg(dst []byte, seg string) ([]byte, error) {
	if len(seg) == 0 || len(seg) > 4 {
		return nil, fmt.Errorf("aml: name segment %q must be 1 to 4 characters", seg)
	}
	for i := 0; i < len(seg); i++ {
		c := seg[i]
		ok := c == '_' || (c >= 'A' && c <= 'Z') || (i > 0 && c >= '0' && c <= '9')
		if !ok {
			return nil, fmt.Errorf("aml: name segment %q: character %q not allowed (want A-Z, _ or, after the first, 0-9)", seg, c)
		}
	}
	dst = append(dst, seg...)
	for i := len(seg); i < 4; i++ {
		dst = append(dst, '_')
	}
	return dst, nil
}

// appendNameString appends a NameString: an optional root ('\') or parent
// ('^', repeatable) prefix followed by dot-separated NameSegs, such as
// `\_SB.COM1`, `^PWRB` or `_HID`.
func appendNameString(dst []byte, path string) ([]byte, error) {
	if path == "" {
		return nil, errors.New("aml: empty name")
	}
	rest := path
	switch {
	case rest[0] == '\\':
		dst = append(dst, opRoot)
		rest = rest[1:]
	default:
		for len(rest) > 0 && rest[0] == '^' {
			dst = append(dst, opParent)
			rest = rest[1:]
		}
	}
	if rest == "" {
		if path == `\` {
			return append(dst, 0x00), nil // NullName: the root itself
		}
		return nil, fmt.Errorf("aml: name %q has no segments", path)
	}
	segs := strings.Split(rest, ".")
	switch {
	case len(segs) == 2:
		dst = append(dst, opDualName)
	case len(segs) > 2:
		if len(segs) > 255 {
			return nil, fmt.Errorf("aml: name %q has more than 255 segments", path)
		}
		dst = append(dst, opMultiName, byte(len(segs)))
	}
	for _, s := range segs {
		var err error
		if dst, err = appendNameSeg(dst, s); err != nil {
			return nil, fmt.Errorf("aml: name %q: %w", path, err)
		}
	}
	return dst, nil
}

// Integer is an AML integer constant. It is encoded as ZeroOp, OneOp or
// the shortest of BytePrefix, WordPrefix, DWordPrefix and QWordPrefix.
type Integer uint64

// AppendAML implements Term.
func (v Integer) AppendAML(dst []byte) ([]byte, error) {
	switch {
	case v == 0:
		return append(dst, opZero), nil
	case v == 1:
		return append(dst, opOne), nil
	case v <= 0xFF:
		return append(dst, opBytePrefix, byte(v)), nil
	case v <= 0xFFFF:
		return binary.LittleEndian.AppendUint16(append(dst, opWordPrefix), uint16(v)), nil
	case v <= 0xFFFFFFFF:
		return binary.LittleEndian.AppendUint32(append(dst, opDWordPrefix), uint32(v)), nil
	}
	return binary.LittleEndian.AppendUint64(append(dst, opQWordPrefix), uint64(v)), nil
}

// OnesOp is an integer with all bits set: ASL Ones.
type OnesOp struct{}

// AppendAML implements Term.
func (OnesOp) AppendAML(dst []byte) ([]byte, error) { return append(dst, opOnes), nil }

// String is an AML string constant: ASCII characters 0x01-0x7F, stored
// NUL-terminated.
type String string

// AppendAML implements Term.
func (s String) AppendAML(dst []byte) ([]byte, error) {
	for i := 0; i < len(s); i++ {
		if s[i] == 0 || s[i] > 0x7F {
			return nil, fmt.Errorf("aml: string %q: byte %#x at %d is not ASCII 0x01-0x7F", string(s), s[i], i)
		}
	}
	dst = append(dst, opStrPrefix)
	dst = append(dst, s...)
	return append(dst, 0), nil
}

// EISAID is a seven-character PNP ID ("PNP0501": three letters A-Z and four
// hex digits) compressed into a 32-bit integer, as ASL EisaId() does.
type EISAID string

// Value returns the compressed 32-bit form of the ID.
func (id EISAID) Value() (uint32, error) {
	s := string(id)
	if len(s) != 7 {
		return 0, fmt.Errorf("aml: EISA ID %q must be 7 characters", s)
	}
	var v uint32
	for i := 0; i < 3; i++ {
		if s[i] < 'A' || s[i] > 'Z' {
			return 0, fmt.Errorf("aml: EISA ID %q: character %d must be A-Z", s, i)
		}
		v = v<<5 | uint32(s[i]-'@')
	}
	for i := 3; i < 7; i++ {
		d, ok := hexDigit(s[i])
		if !ok {
			return 0, fmt.Errorf("aml: EISA ID %q: character %d must be a hex digit", s, i)
		}
		v = v<<4 | uint32(d)
	}
	// The ID is stored big-endian in the byte stream; read back as a
	// little-endian DWord its bytes are swapped.
	return bits.ReverseBytes32(v), nil
}

func hexDigit(c byte) (byte, bool) {
	switch {
	case c >= '0' && c <= '9':
		return c - '0', true
	case c >= 'A' && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}

// AppendAML implements Term. Like iasl, it always uses DWordPrefix.
func (id EISAID) AppendAML(dst []byte) ([]byte, error) {
	v, err := id.Value()
	if err != nil {
		return nil, err
	}
	return binary.LittleEndian.AppendUint32(append(dst, opDWordPrefix), v), nil
}

// Path is a reference to a named object, such as `PWRB` or `\_SB.VGEN`.
type Path string

// AppendAML implements Term.
func (p Path) AppendAML(dst []byte) ([]byte, error) { return appendNameString(dst, string(p)) }

// Local is a method local variable, Local0 to Local7.
type Local uint8

// AppendAML implements Term.
func (l Local) AppendAML(dst []byte) ([]byte, error) {
	if l > 7 {
		return nil, fmt.Errorf("aml: Local%d does not exist (Local0-Local7)", l)
	}
	return append(dst, opLocal0+byte(l)), nil
}

// Arg is a method argument, Arg0 to Arg6.
type Arg uint8

// AppendAML implements Term.
func (a Arg) AppendAML(dst []byte) ([]byte, error) {
	if a > 6 {
		return nil, fmt.Errorf("aml: Arg%d does not exist (Arg0-Arg6)", a)
	}
	return append(dst, opArg0+byte(a)), nil
}

// termFunc adapts a function to Term.
type termFunc func(dst []byte) ([]byte, error)

func (f termFunc) AppendAML(dst []byte) ([]byte, error) { return f(dst) }

// Name declares a named object: ASL Name(name, value).
func Name(name string, value Term) Term {
	return termFunc(func(dst []byte) ([]byte, error) {
		dst = append(dst, opName)
		dst, err := appendNameString(dst, name)
		if err != nil {
			return nil, err
		}
		if value == nil {
			return nil, fmt.Errorf("aml: Name(%s): nil value", name)
		}
		return value.AppendAML(dst)
	})
}

// Scope opens a scope: ASL Scope(path) { body }.
func Scope(path string, body ...Term) Term {
	return termFunc(func(dst []byte) ([]byte, error) {
		inner, err := appendNameString(nil, path)
		if err != nil {
			return nil, err
		}
		if inner, err = appendTerms(inner, body); err != nil {
			return nil, fmt.Errorf("aml: Scope(%s): %w", path, err)
		}
		return appendPackage(dst, []byte{opScope}, inner)
	})
}

// Device declares a device: ASL Device(name) { body }.
func Device(name string, body ...Term) Term {
	return termFunc(func(dst []byte) ([]byte, error) {
		inner, err := appendNameString(nil, name)
		if err != nil {
			return nil, err
		}
		if inner, err = appendTerms(inner, body); err != nil {
			return nil, fmt.Errorf("aml: Device(%s): %w", name, err)
		}
		return appendPackage(dst, []byte{opExtPrefix, extDevice}, inner)
	})
}

// Method declares a control method with args arguments (0-7), sync level 0:
// ASL Method(name, args, Serialized|NotSerialized) { body }.
func Method(name string, args int, serialized bool, body ...Term) Term {
	return termFunc(func(dst []byte) ([]byte, error) {
		if args < 0 || args > 7 {
			return nil, fmt.Errorf("aml: Method(%s): %d arguments, want 0-7", name, args)
		}
		inner, err := appendNameString(nil, name)
		if err != nil {
			return nil, err
		}
		flags := byte(args)
		if serialized {
			flags |= 1 << 3
		}
		inner = append(inner, flags)
		if inner, err = appendTerms(inner, body); err != nil {
			return nil, fmt.Errorf("aml: Method(%s): %w", name, err)
		}
		return appendPackage(dst, []byte{opMethod}, inner)
	})
}

// Package is a fixed package of at most 255 elements: ASL Package() {...}.
func Package(elems ...Term) Term {
	return termFunc(func(dst []byte) ([]byte, error) {
		if len(elems) > 255 {
			return nil, fmt.Errorf("aml: Package of %d elements, at most 255", len(elems))
		}
		inner, err := appendTerms([]byte{byte(len(elems))}, elems)
		if err != nil {
			return nil, fmt.Errorf("aml: Package: %w", err)
		}
		return appendPackage(dst, []byte{opPackage}, inner)
	})
}

// Buffer is a buffer initialized with data: ASL Buffer() { data }.
func Buffer(data []byte) Term {
	return termFunc(func(dst []byte) ([]byte, error) {
		inner, err := Integer(len(data)).AppendAML(nil)
		if err != nil {
			return nil, err
		}
		return appendPackage(dst, []byte{opBuffer}, append(inner, data...))
	})
}

// RegionSpace is the address space of an operation region.
type RegionSpace uint8

// Operation region spaces (ACPI 6.5, section 19.6.100).
const (
	SystemMemory RegionSpace = 0x00
	SystemIO     RegionSpace = 0x01
)

// OperationRegion declares a region of an address space:
// ASL OperationRegion(name, space, offset, length).
func OperationRegion(name string, space RegionSpace, offset, length Term) Term {
	return termFunc(func(dst []byte) ([]byte, error) {
		dst = append(dst, opExtPrefix, extOpRegion)
		dst, err := appendNameString(dst, name)
		if err != nil {
			return nil, err
		}
		dst = append(dst, byte(space))
		if dst, err = appendTerms(dst, []Term{offset, length}); err != nil {
			return nil, fmt.Errorf("aml: OperationRegion(%s): %w", name, err)
		}
		return dst, nil
	})
}

// FieldAccess is the access width of a field (AccessType of FieldFlags).
type FieldAccess uint8

// Field access types.
const (
	AnyAcc   FieldAccess = 0
	ByteAcc  FieldAccess = 1
	WordAcc  FieldAccess = 2
	DWordAcc FieldAccess = 3
	QWordAcc FieldAccess = 4
)

// FieldUpdate is what a write does with the bits of a field's access unit
// that the field does not cover (UpdateRule of FieldFlags).
type FieldUpdate uint8

// Field update rules.
const (
	Preserve     FieldUpdate = 0
	WriteAsOnes  FieldUpdate = 1
	WriteAsZeros FieldUpdate = 2
)

// FieldUnit is one entry of a Field: Bits bits named Name, or, with an
// empty Name, Bits reserved bits to skip.
type FieldUnit struct {
	Name string
	Bits uint32
}

// Field declares named bit fields over an operation region:
// ASL Field(region, access, Lock|NoLock, update) { units }.
func Field(region string, access FieldAccess, lock bool, update FieldUpdate, units ...FieldUnit) Term {
	return termFunc(func(dst []byte) ([]byte, error) {
		if access > QWordAcc {
			return nil, fmt.Errorf("aml: Field(%s): access type %d, want 0-4", region, access)
		}
		if update > WriteAsZeros {
			return nil, fmt.Errorf("aml: Field(%s): update rule %d, want 0-2", region, update)
		}
		inner, err := appendNameString(nil, region)
		if err != nil {
			return nil, err
		}
		flags := byte(access) | byte(update)<<5
		if lock {
			flags |= 1 << 4
		}
		inner = append(inner, flags)
		for _, u := range units {
			if u.Name == "" {
				inner = append(inner, 0x00) // ReservedField
			} else if inner, err = appendNameSeg(inner, u.Name); err != nil {
				return nil, fmt.Errorf("aml: Field(%s): %w", region, err)
			}
			if inner, err = appendFieldLength(inner, u.Bits); err != nil {
				return nil, fmt.Errorf("aml: Field(%s): %w", region, err)
			}
		}
		return appendPackage(dst, []byte{opExtPrefix, extField}, inner)
	})
}

// If runs body when predicate is non-zero: ASL If(predicate) { body }.
func If(predicate Term, body ...Term) Term {
	return termFunc(func(dst []byte) ([]byte, error) {
		inner, err := appendTerms(nil, append([]Term{predicate}, body...))
		if err != nil {
			return nil, fmt.Errorf("aml: If: %w", err)
		}
		return appendPackage(dst, []byte{opIf}, inner)
	})
}

// Else runs body when the If just before it did not: ASL Else { body }.
func Else(body ...Term) Term {
	return termFunc(func(dst []byte) ([]byte, error) {
		inner, err := appendTerms(nil, body)
		if err != nil {
			return nil, fmt.Errorf("aml: Else: %w", err)
		}
		return appendPackage(dst, []byte{opElse}, inner)
	})
}

// op returns a term made of an opcode followed by its operands.
func op(name string, code byte, operands ...Term) Term {
	return termFunc(func(dst []byte) ([]byte, error) {
		dst, err := appendTerms(append(dst, code), operands)
		if err != nil {
			return nil, fmt.Errorf("aml: %s: %w", name, err)
		}
		return dst, nil
	})
}

// target returns t, or the NullName (no target) when t is nil.
func target(t Term) Term {
	if t == nil {
		return termFunc(func(dst []byte) ([]byte, error) { return append(dst, 0x00), nil })
	}
	return t
}

// Store copies src into dst: ASL Store(src, dst), or dst = src.
func Store(src, dst Term) Term { return op("Store", opStore, src, dst) }

// And is the bitwise and of a and b, also stored into result unless it is
// nil: ASL And(a, b, result).
func And(a, b, result Term) Term { return op("And", opAnd, a, b, target(result)) }

// Or is the bitwise or of a and b, also stored into result unless it is
// nil: ASL Or(a, b, result).
func Or(a, b, result Term) Term { return op("Or", opOr, a, b, target(result)) }

// LAnd is the logical and of a and b: ASL LAnd(a, b), or a && b.
func LAnd(a, b Term) Term { return op("LAnd", opLAnd, a, b) }

// LOr is the logical or of a and b: ASL LOr(a, b), or a || b.
func LOr(a, b Term) Term { return op("LOr", opLOr, a, b) }

// LNot is the logical negation of a: ASL LNot(a), or !a.
func LNot(a Term) Term { return op("LNot", opLNot, a) }

// LEqual compares a and b: ASL LEqual(a, b), or a == b.
func LEqual(a, b Term) Term { return op("LEqual", opLEqual, a, b) }

// Notify sends a notification value to object: ASL Notify(object, value).
func Notify(object, value Term) Term { return op("Notify", opNotify, object, value) }

// Return returns value from a method: ASL Return(value).
func Return(value Term) Term { return op("Return", opReturn, value) }

// Call invokes the method at path with args: ASL path(args). AML carries
// no argument count, so the method must take exactly len(args) arguments.
func Call(path string, args ...Term) Term {
	return termFunc(func(dst []byte) ([]byte, error) {
		dst, err := appendNameString(dst, path)
		if err != nil {
			return nil, err
		}
		if dst, err = appendTerms(dst, args); err != nil {
			return nil, fmt.Errorf("aml: call %s: %w", path, err)
		}
		return dst, nil
	})
}
