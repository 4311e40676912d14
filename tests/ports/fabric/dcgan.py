"""Port of Lightning Fabric's ``examples/fabric/dcgan/train_fabric.py`` (the PyTorch DCGAN
tutorial on CelebA: a ConvTranspose2d generator and a Conv2d discriminator with
BatchNorm, ``weights_init``, BCELoss, two Adam optimizers, fixed noise), written against
ember's names.

Same structure and API usage as the original: ``seed_everything`` before ``Fabric()``, a
shuffled DataLoader of which one batch is read before it is set up (the original plots
it), ``generator.apply(weights_init)``, ``fabric.setup(model, optimizer)`` once per
network, ``setup_dataloaders``, ``zero_grad`` on the set-up modules, three
discriminator passes per iteration (real, ``fake.detach()``, ``fake``) with a
``fabric.backward`` after each, ``fixed_noise`` on ``fabric.device``, ``fabric.print``,
``fabric.is_global_zero`` and ``fabric.barrier`` around the sample images.

Changed from the original, and why: ``from ember import Fabric, seed_everything`` (for
``lightning.fabric``); CelebA 64x64 RGB is scikit-learn's 8x8 digits scaled to [-1, 1]
(one channel, no download), so the networks have three layers instead of five (the
same layer kinds, with 8x8 sizes) and ``nz``/``ngf``/``ndf`` are 16/8/8; batches of 64,
2 epochs; ``num_workers=0`` (the original takes ``os.cpu_count()``: worker processes
would only slow a test on a shared machine; the loader draws the same from the global
RNG either way); no torchvision: the sample images are summed instead of saved;
``Fabric(**fabric_kwargs())`` names the processes (the original: one device); the
numbers are written to ``PORT_OUT`` for the comparison.

Features used: setup (two models, two optimizers), setup_dataloaders (shuffled), a
loader read before setup, backward (three per iteration, one through both models),
BatchNorm buffers (broadcast by DDP), device, print, is_global_zero, barrier.

    python tests/ports/fabric/dcgan.py   (PORT_OUT=results.json PORT_DEVICES=2)
"""
import torch
import torch.nn as nn
import torch.nn.parallel
import torch.optim as optim
import torch.utils.data

from common import fabric_kwargs, param_sums, write

from ember import Fabric, seed_everything  # (from lightning.fabric import Fabric, seed_everything)

# Number of workers for dataloader
workers = 0   # (os.cpu_count())
# Batch size during training
batch_size = 64   # (128)
# Spatial size of training images
image_size = 8   # (64)
# Number of channels in the training images
nc = 1   # (3)
# Size of z latent vector (i.e. size of generator input)
nz = 16   # (100)
# Size of feature maps in generator
ngf = 8   # (64)
# Size of feature maps in discriminator
ndf = 8   # (64)
# Number of training epochs
num_epochs = 2   # (5)
# Learning rate for optimizers
lr = 0.0002
# Beta1 hyperparameter for Adam optimizers
beta1 = 0.5


class DigitImages(torch.utils.data.Dataset):
    """Stand-in for CelebA with ``ToTensor`` and ``Normalize((0.5,), (0.5,))``: scikit-learn's
    1,797 8x8 digits as ``(image[1, 8, 8] in [-1, 1], label)``."""

    def __init__(self) -> None:
        from sklearn.datasets import load_digits
        d = load_digits()
        x = torch.tensor(d.data, dtype=torch.float32).div_(16.0).view(-1, nc, image_size, image_size)
        self.data, self.targets = (x - 0.5) / 0.5, torch.tensor(d.target, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, idx: int):
        return self.data[idx], self.targets[idx]


def main():
    # Set random seed for reproducibility
    seed_everything(999)

    fabric = Fabric(**fabric_kwargs())   # (Fabric(accelerator="auto", devices=1))
    fabric.launch()

    dataset = DigitImages()

    # Create the dataloader
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers)

    # Plot some training images (the original saves them with torchvision)
    real_batch = next(iter(dataloader))
    sample_data = real_batch[0][:64].sum()

    # Create the generator
    generator = Generator()

    # Apply the weights_init function to randomly initialize all weights
    generator.apply(weights_init)

    # Create the Discriminator
    discriminator = Discriminator()

    # Apply the weights_init function to randomly initialize all weights
    discriminator.apply(weights_init)

    # Initialize BCELoss function
    criterion = nn.BCELoss()

    # Create batch of latent vectors that we will use to visualize
    #  the progression of the generator
    fixed_noise = torch.randn(64, nz, 1, 1, device=fabric.device)

    # Establish convention for real and fake labels during training
    real_label = 1.0
    fake_label = 0.0

    # Set up Adam optimizers for both G and D
    optimizer_d = optim.Adam(discriminator.parameters(), lr=lr, betas=(beta1, 0.999))
    optimizer_g = optim.Adam(generator.parameters(), lr=lr, betas=(beta1, 0.999))

    discriminator, optimizer_d = fabric.setup(discriminator, optimizer_d)
    generator, optimizer_g = fabric.setup(generator, optimizer_g)
    dataloader = fabric.setup_dataloaders(dataloader)

    # Lists to keep track of progress
    losses_g = []
    losses_d = []
    d_outputs = []
    samples = []
    iteration = 0

    # Training loop
    for epoch in range(num_epochs):
        for i, data in enumerate(dataloader, 0):
            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            # (a) Train with all-real batch
            discriminator.zero_grad()
            real_cpu = data[0]
            b_size = real_cpu.size(0)
            label = torch.full((b_size,), real_label, dtype=torch.float, device=fabric.device)
            # Forward pass real batch through D
            output = discriminator(real_cpu).view(-1)
            # Calculate loss on all-real batch
            err_d_real = criterion(output, label)
            # Calculate gradients for D in backward pass
            fabric.backward(err_d_real)
            d_x = output.mean().item()

            # (b) Train with all-fake batch
            # Generate batch of latent vectors
            noise = torch.randn(b_size, nz, 1, 1, device=fabric.device)
            # Generate fake image batch with G
            fake = generator(noise)
            label.fill_(fake_label)
            # Classify all fake batch with D
            output = discriminator(fake.detach()).view(-1)
            # Calculate D's loss on the all-fake batch
            err_d_fake = criterion(output, label)
            # Calculate the gradients for this batch, accumulated (summed) with previous gradients
            fabric.backward(err_d_fake)
            d_g_z1 = output.mean().item()
            # Compute error of D as sum over the fake and the real batches
            err_d = err_d_real + err_d_fake
            # Update D
            optimizer_d.step()

            # (2) Update G network: maximize log(D(G(z)))
            generator.zero_grad()
            label.fill_(real_label)  # fake labels are real for generator cost
            # Since we just updated D, perform another forward pass of all-fake batch through D
            output = discriminator(fake).view(-1)
            # Calculate G's loss based on this output
            err_g = criterion(output, label)
            # Calculate gradients for G
            fabric.backward(err_g)
            d_g_z2 = output.mean().item()
            # Update G
            optimizer_g.step()

            # Output training stats
            if i % 10 == 0:   # (50)
                fabric.print(
                    f"[{epoch}/{num_epochs}][{i}/{len(dataloader)}]\t"
                    f"Loss_D: {err_d.item():.4f}\t"
                    f"Loss_G: {err_g.item():.4f}\t"
                    f"D(x): {d_x:.4f}\t"
                    f"D(G(z)): {d_g_z1:.4f} / {d_g_z2:.4f}"
                )

            # Save Losses for plotting later
            losses_g.append(err_g.item())
            losses_d.append(err_d.item())
            d_outputs.append([d_x, d_g_z1, d_g_z2])

            # Check how the generator is doing by saving G's output on fixed_noise
            if (iteration % 10 == 0) or ((epoch == num_epochs - 1) and (i == len(dataloader) - 1)):   # (500)
                with torch.no_grad():
                    fake = generator(fixed_noise).detach().cpu()

                if fabric.is_global_zero:
                    samples.append(fake.double().sum().item())   # (torchvision.utils.save_image(fake, ...))
                fabric.barrier()

            iteration += 1

    write(fabric, train_losses=losses_g, losses_d=losses_d, d_outputs=d_outputs, samples=samples,
          sample_data=sample_data, n_train_batches=len(dataloader),
          params={**{f"G.{k}": v for k, v in param_sums(generator).items()},
                  **{f"D.{k}": v for k, v in param_sums(discriminator).items()}})


def weights_init(m):
    # custom weights initialization called on netG and netD
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        nn.init.normal_(m.weight.data, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        nn.init.normal_(m.weight.data, 1.0, 0.02)
        nn.init.constant_(m.bias.data, 0)


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            # input is Z, going into a convolution
            nn.ConvTranspose2d(nz, ngf * 4, 2, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            # state size. (ngf*4) x 2 x 2
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            # state size. (ngf*2) x 4 x 4
            nn.ConvTranspose2d(ngf * 2, nc, 4, 2, 1, bias=False),
            nn.Tanh()
            # state size. (nc) x 8 x 8
        )

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            # input is (nc) x 8 x 8
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf) x 4 x 4
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf*2) x 2 x 2
            nn.Conv2d(ndf * 2, 1, 2, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, input):
        return self.main(input)


if __name__ == "__main__":
    main()
