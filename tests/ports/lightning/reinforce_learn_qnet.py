"""Port of Lightning's ``examples/pytorch/domain_templates/reinforce_learn_Qnet.py`` (a
Deep Q-Network on CartPole), written against ember's names.

Same structure and API usage as the original: a ``ReplayBuffer`` sampled with python's
``random.sample``, an ``RLDataset`` (an ``IterableDataset`` with no length, one pass of
``episode_length`` experiences per epoch), an ``Agent`` whose epsilon-greedy policy draws
from ``random.random()``, a module that plays one environment step in every
``training_step``, copies its net into a target net every ``sync_rate`` steps, reads
``self.global_step`` and ``self.on_gpu``, returns ``OrderedDict({"loss", "log",
"progress_bar"})`` (Lightning 0.x's dict, whose extra keys both libraries ignore) and
builds its ``DataLoader`` in ``train_dataloader``; ``Trainer(accelerator="cpu",
devices=1, val_check_interval=100)`` with no validation data; ``seed_everything(0)``.

This is the example where the user's own random streams matter: the replay sampling and
the policy draw from the global python ``random`` during the fit, so a library that
draws from it too (a logger or progress bar imported for the first time during the fit)
trains on other experiences. The test compares the weights, the rewards and the next
draw of each global generator after the fit with Lightning's.

Changed from the original, and why:
- imports: ``ember`` names where it imports ``lightning.pytorch``;
- no gym here: ``CartPole`` below is gym's ``CartPole-v1`` (the classic-control
  equations, Euler steps, a 500-step time limit, the old 4-tuple ``step`` API), with its
  own generator seeded 0 (gym's ``env.np_random``, which ``seed_everything`` does not
  seed: the original's runs differ from one another);
- 8 epochs (``max_epochs``; Lightning's default is 1000), ``default_root_dir`` the
  working directory, no command-line arguments (the original's defaults are passed);
- the numbers are written out for the comparison.

Features used: an IterableDataset without length re-iterated every epoch,
val_check_interval with no validation data, a dict returned by training_step,
self.global_step, self.on_gpu, train_dataloader on the module.

    python tests/ports/lightning/reinforce_learn_qnet.py   (PORT_OUT=results.json)
"""
import math
import os
import random
from collections import OrderedDict, deque, namedtuple
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from torch.optim.optimizer import Optimizer
from torch.utils.data import DataLoader
from torch.utils.data.dataset import IterableDataset

from common import param_sums, write

from ember import TrainModule, Trainer, seed_everything  # (from lightning.pytorch import LightningModule, ...)


# -- gym's CartPole-v1, as its classic-control source computes it ---------------------------------------
class Discrete:
    def __init__(self, n: int, rng: np.random.Generator) -> None:
        self.n, self._rng = n, rng

    def sample(self) -> int:
        return int(self._rng.integers(self.n))


class Box:
    def __init__(self, shape: tuple) -> None:
        self.shape = shape


class CartPole:
    gravity, masscart, masspole, length, force_mag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    theta_threshold_radians, x_threshold, max_episode_steps = 12 * 2 * math.pi / 360, 2.4, 500

    def __init__(self, seed: int = 0) -> None:
        self.np_random = np.random.default_rng(seed)
        self.action_space = Discrete(2, self.np_random)
        self.observation_space = Box((4,))
        self.total_mass = self.masspole + self.masscart
        self.polemass_length = self.masspole * self.length
        self.state, self.steps = None, 0

    def reset(self) -> np.ndarray:
        self.state, self.steps = self.np_random.uniform(low=-0.05, high=0.05, size=(4,)), 0
        return np.array(self.state, dtype=np.float32)

    def step(self, action: int) -> tuple:
        x, x_dot, theta, theta_dot = self.state
        force = self.force_mag if action == 1 else -self.force_mag
        costheta, sintheta = math.cos(theta), math.sin(theta)
        temp = (force + self.polemass_length * theta_dot**2 * sintheta) / self.total_mass
        thetaacc = (self.gravity * sintheta - costheta * temp) / (
            self.length * (4.0 / 3.0 - self.masspole * costheta**2 / self.total_mass))
        xacc = temp - self.polemass_length * thetaacc * costheta / self.total_mass
        x, x_dot = x + self.tau * x_dot, x_dot + self.tau * xacc
        theta, theta_dot = theta + self.tau * theta_dot, theta_dot + self.tau * thetaacc
        self.state, self.steps = (x, x_dot, theta, theta_dot), self.steps + 1
        done = bool(x < -self.x_threshold or x > self.x_threshold or theta < -self.theta_threshold_radians
                    or theta > self.theta_threshold_radians or self.steps >= self.max_episode_steps)
        return np.array(self.state, dtype=np.float32), 1.0, done, {}


def make(env: str) -> CartPole:   # (gym.make)
    assert env == "CartPole-v1", env
    return CartPole()


# -- the example -------------------------------------------------------------------------------------------
class DQN(nn.Module):
    """Simple MLP network."""

    def __init__(self, obs_size: int, n_actions: int, hidden_size: int = 128):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_size, hidden_size), nn.ReLU(), nn.Linear(hidden_size, n_actions))

    def forward(self, x):
        return self.net(x.float())


# Named tuple for storing experience steps gathered in training
Experience = namedtuple("Experience", field_names=["state", "action", "reward", "done", "new_state"])


class ReplayBuffer:
    """Replay Buffer for storing past experiences allowing the agent to learn from them."""

    def __init__(self, capacity: int) -> None:
        self.buffer = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self.buffer)

    def append(self, experience: Experience) -> None:
        self.buffer.append(experience)

    def sample(self, batch_size: int) -> tuple:
        indices = random.sample(range(len(self.buffer)), batch_size)
        states, actions, rewards, dones, next_states = zip(*(self.buffer[idx] for idx in indices))

        return (
            torch.tensor(np.array(states)),
            torch.tensor(actions),
            torch.tensor(rewards, dtype=torch.float32),
            torch.tensor(dones, dtype=torch.bool),
            torch.tensor(np.array(next_states)),
        )


class RLDataset(IterableDataset):
    """Iterable Dataset containing the ExperienceBuffer which will be updated with new experiences during training."""

    def __init__(self, buffer: ReplayBuffer, sample_size: int = 200) -> None:
        self.buffer = buffer
        self.sample_size = sample_size

    def __iter__(self) -> Iterator:
        states, actions, rewards, dones, new_states = self.buffer.sample(self.sample_size)
        for i in range(len(dones)):
            yield states[i], actions[i], rewards[i], dones[i], new_states[i]


class Agent:
    """Base Agent class handling the interaction with the environment."""

    def __init__(self, env: CartPole, replay_buffer: ReplayBuffer) -> None:
        self.env = env
        self.replay_buffer = replay_buffer
        self.reset()
        self.state = self.env.reset()

    def reset(self) -> None:
        """Resets the environment and updates the state."""
        self.state = self.env.reset()

    def get_action(self, net: nn.Module, epsilon: float, device: str) -> int:
        """Using the given network, decide what action to carry out using an epsilon-greedy policy."""
        if random.random() < epsilon:
            action = self.env.action_space.sample()
        else:
            state = torch.tensor(np.array([self.state]))

            if device not in ["cpu"]:
                state = state.cuda(device)

            q_values = net(state)
            _, action = torch.max(q_values, dim=1)
            action = int(action.item())

        return action

    @torch.no_grad()
    def play_step(self, net: nn.Module, epsilon: float = 0.0, device: str = "cpu") -> tuple[float, bool]:
        """Carries out a single interaction step between the agent and the environment."""
        action = self.get_action(net, epsilon, device)

        # do step in the environment
        new_state, reward, done, _ = self.env.step(action)

        exp = Experience(self.state, action, reward, done, new_state)

        self.replay_buffer.append(exp)

        self.state = new_state
        if done:
            self.reset()
        return reward, done


class DQNLightning(TrainModule):
    """Basic DQN Model."""

    def __init__(self, env: str, replay_size: int = 200, warm_start_steps: int = 200, gamma: float = 0.99,
                 eps_start: float = 1.0, eps_end: float = 0.01, eps_last_frame: int = 200, sync_rate: int = 10,
                 lr: float = 1e-2, episode_length: int = 50, batch_size: int = 4, **kwargs) -> None:
        super().__init__(**kwargs)
        self.replay_size = replay_size
        self.warm_start_steps = warm_start_steps
        self.gamma = gamma
        self.eps_start = eps_start
        self.eps_end = eps_end
        self.eps_last_frame = eps_last_frame
        self.sync_rate = sync_rate
        self.lr = lr
        self.episode_length = episode_length
        self.batch_size = batch_size

        self.env = make(env)
        obs_size = self.env.observation_space.shape[0]
        n_actions = self.env.action_space.n

        self.net = DQN(obs_size, n_actions)
        self.target_net = DQN(obs_size, n_actions)

        self.buffer = ReplayBuffer(self.replay_size)
        self.agent = Agent(self.env, self.buffer)
        self.total_reward = 0
        self.episode_reward = 0
        self.populate(self.warm_start_steps)

    def populate(self, steps: int = 1000) -> None:
        """Carries out several random steps through the environment to initially fill up the replay buffer."""
        for i in range(steps):
            self.agent.play_step(self.net, epsilon=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def dqn_mse_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Calculates the mse loss using a mini batch from the replay buffer."""
        states, actions, rewards, dones, next_states = batch

        state_action_values = self.net(states).gather(1, actions.unsqueeze(-1)).squeeze(-1)

        with torch.no_grad():
            next_state_values = self.target_net(next_states).max(1)[0]
            next_state_values[dones] = 0.0
            next_state_values = next_state_values.detach()

        expected_state_action_values = next_state_values * self.gamma + rewards

        return nn.MSELoss()(state_action_values, expected_state_action_values)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], nb_batch) -> OrderedDict:
        """One step through the environment to update the replay buffer, then the loss on the mini batch."""
        device = self.get_device(batch)
        epsilon = max(self.eps_end, self.eps_start - (self.global_step + 1) / self.eps_last_frame)

        # step through environment with agent
        reward, done = self.agent.play_step(self.net, epsilon, device)
        self.episode_reward += reward

        # calculates training loss
        loss = self.dqn_mse_loss(batch)

        if done:
            self.total_reward = self.episode_reward
            self.episode_reward = 0

        # Soft update of target network
        if self.global_step % self.sync_rate == 0:
            self.target_net.load_state_dict(self.net.state_dict())

        log = {
            "total_reward": torch.tensor(self.total_reward).to(device),
            "reward": torch.tensor(reward).to(device),
            "steps": torch.tensor(self.global_step).to(device),
        }

        return OrderedDict({"loss": loss, "log": log, "progress_bar": log})

    def configure_optimizers(self) -> list[Optimizer]:
        """Initialize Adam optimizer."""
        optimizer = optim.Adam(self.net.parameters(), lr=self.lr)
        return [optimizer]

    def __dataloader(self) -> DataLoader:
        """Initialize the Replay Buffer dataset used for retrieving experiences."""
        dataset = RLDataset(self.buffer, self.episode_length)
        return DataLoader(dataset=dataset, batch_size=self.batch_size, sampler=None)

    def train_dataloader(self) -> DataLoader:
        return self.__dataloader()

    def get_device(self, batch) -> str:
        """Retrieve device currently being used by minibatch."""
        return batch[0].device.index if self.on_gpu else "cpu"


def main() -> None:
    # the original's command-line defaults
    model = DQNLightning(env="CartPole-v1", batch_size=16, lr=1e-2, gamma=0.99, sync_rate=10, replay_size=1000,
                         warm_start_steps=1000, eps_last_frame=1000, eps_start=1.0, eps_end=0.01, episode_length=200)
    trainer = Trainer(accelerator="cpu", devices=1, val_check_interval=100, max_epochs=8,
                      default_root_dir=os.getcwd())
    trainer.fit(model)
    write(trainer, params=param_sums(model), global_step=trainer.global_step, total_reward=model.total_reward,
          episode_reward=model.episode_reward, buffer_len=len(model.buffer),
          buffer_state_sum=float(np.sum([e.state.astype(np.float64).sum() for e in model.buffer.buffer])),
          # the next draw of each global generator: equal when neither library drew from them during the fit
          next_draws={"python": random.random(), "numpy": float(np.random.rand()), "torch": torch.rand(1).item()})


if __name__ == "__main__":
    seed_everything(0)
    main()
