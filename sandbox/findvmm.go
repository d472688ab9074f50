package sandbox

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
)

// VMMEnv names the environment variable FindVMM reads first.
const VMMEnv = "KILN_VMM"

// VMMName is the VMM binary's name (cmd/kiln-vmm), which FindVMM looks
// for beside the running executable and then on $PATH.
const VMMName = "kiln-vmm"

// FindVMM returns the kiln-vmm binary that VMM processes run
// (ProcessOptions.Command is [FindVMM()]): $KILN_VMM, else kiln-vmm
// beside the running executable (make build and make install put kiln,
// kilnd and kiln-vmm side by side), else kiln-vmm on $PATH. The path is
// absolute, so it names the same file whatever the working directory of
// a later start. The error names every place it looked.
func FindVMM() (string, error) {
	if p := os.Getenv(VMMEnv); p != "" {
		abs, err := executableFile(p)
		if err != nil {
			return "", fmt.Errorf("sandbox: $%s: %w", VMMEnv, err)
		}
		return abs, nil
	}
	beside := "(this program's path is unknown)"
	if exe, err := os.Executable(); err == nil {
		beside = filepath.Join(filepath.Dir(exe), VMMName)
		if abs, err := executableFile(beside); err == nil {
			return abs, nil
		}
	}
	if p, err := exec.LookPath(VMMName); err == nil {
		if abs, err := executableFile(p); err == nil {
			return abs, nil
		}
	}
	return "", fmt.Errorf("sandbox: no %s binary: $%s is unset, none at %s, none on $PATH (run make build or make install, or set $%s)", VMMName, VMMEnv, beside, VMMEnv)
}

// executableFile returns p made absolute if it names an executable
// regular file.
func executableFile(p string) (string, error) {
	abs, err := filepath.Abs(p)
	if err != nil {
		return "", err
	}
	fi, err := os.Stat(abs)
	if err != nil {
		return "", err
	}
	if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
		return "", errors.New(abs + " is not an executable file")
	}
	return abs, nil
}
