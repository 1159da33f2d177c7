module allocbox.local/bump

go 1.27
