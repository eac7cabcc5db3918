%% @private
%% What convoy holds for one node now, and the only module that touches it.
%%
%% Each node row (`convoy_peers' creates it) has an `atomics' array with two slots:
%% messages handed to a lane for that node and not yet shipped or dropped, and
%% their estimated bytes. Senders take room (`hold/4') before handing a message
%% to a lane, within the node's bounds (`max_buffered', `max_buffered_bytes');
%% the lane gives it back as messages leave (`release/3'). Lane mailboxes are
%% included, so the bounds hold whatever the lane is doing.
%%
%% Forgetting a row (`convoy_peers', only for a node that is not connected and
%% holds nothing): `try_close/1' adds `?CLOSED' to the message slot and keeps it
%% there only if that found 0 messages and 0 bytes. A sender whose `hold/4' lands
%% at or above it undoes its add before touching the byte slot and gets `closed':
%% it must fetch the node's references again. A closed array stays closed; a
%% holder of cached references checks `is_closed/1' before using them.
-module(convoy_held).

-export([new/0, hold/4, release/3, has_room/4, read/1, is_empty/1, is_closed/1,
         try_close/1]).

-export_type([held/0, bound/0]).

-include("convoy_runtime.hrl").

-opaque held() :: atomics:atomics_ref().
-type bound() :: pos_integer() | infinity.

-define(MSGS, 1).
-define(BYTES, 2).

-spec new() -> held().
new() -> atomics:new(2, [{signed, true}]).

%% @doc Take room for one message of `Bytes' within the bounds: `full' (nothing
%% taken) when it does not fit, `closed' when the row was forgotten.
-spec hold(held(), non_neg_integer(), bound(), bound()) -> ok | full | closed.
hold(H, Bytes, MaxN, MaxB) ->
    case atomics:add_get(H, ?MSGS, 1) of
        N when N >= ?CLOSED div 2 ->
            atomics:sub(H, ?MSGS, 1),
            closed;
        N ->
            B = atomics:add_get(H, ?BYTES, Bytes),
            case fits(N - 1, B - Bytes, Bytes, MaxN, MaxB) of
                true ->
                    ok;
                false ->
                    atomics:sub(H, ?MSGS, 1),
                    atomics:sub(H, ?BYTES, Bytes),
                    full
            end
    end.

%% @doc `K' held messages of `Bytes' in all left (shipped or dropped).
-spec release(held(), non_neg_integer(), non_neg_integer()) -> ok.
release(_H, 0, 0) ->
    ok;
release(H, K, Bytes) ->
    atomics:sub(H, ?MSGS, K),
    atomics:sub(H, ?BYTES, Bytes).

%% @doc Whether a message of `Bytes' would fit now (a lane deciding whether to wake
%% a blocked sender; the sender still takes the room with `hold/4').
-spec has_room(held(), non_neg_integer(), bound(), bound()) -> boolean().
has_room(H, Bytes, MaxN, MaxB) ->
    {N, B} = read(H),
    fits(N, B, Bytes, MaxN, MaxB).

%% A message alone may exceed the byte bound.
fits(Held, HeldBytes, Bytes, MaxN, MaxB) ->
    within(Held + 1, MaxN) andalso (HeldBytes =< 0 orelse within(HeldBytes + Bytes, MaxB)).

within(_, infinity) -> true;
within(V, Max) -> V =< Max.

%% @doc Messages and bytes held now (a row being closed reads as what it holds).
-spec read(held()) -> {integer(), integer()}.
read(H) ->
    N = case atomics:get(H, ?MSGS) of
            V when V >= ?CLOSED div 2 -> V - ?CLOSED;
            V -> V
        end,
    {N, atomics:get(H, ?BYTES)}.

%% @doc Nothing held (and not closed).
-spec is_empty(held()) -> boolean().
is_empty(H) ->
    atomics:get(H, ?MSGS) =:= 0 andalso atomics:get(H, ?BYTES) =:= 0.

%% @doc Whether the row was forgotten (or is being checked for it right now).
-spec is_closed(held()) -> boolean().
is_closed(H) ->
    atomics:get(H, ?MSGS) >= ?CLOSED div 2.

%% @doc Close for good if nothing is held; otherwise leave it as it was.
-spec try_close(held()) -> boolean().
try_close(H) ->
    case atomics:add_get(H, ?MSGS, ?CLOSED) =:= ?CLOSED andalso atomics:get(H, ?BYTES) =:= 0 of
        true ->
            true;
        false ->
            atomics:sub(H, ?MSGS, ?CLOSED),
            false
    end.
