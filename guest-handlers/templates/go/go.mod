module allocbox.local/policy

go 1.27
