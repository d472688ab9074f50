//go:build !race

package jail

// raceEnabled: see race_test.go.
const raceEnabled = false
